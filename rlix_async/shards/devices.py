"""What a shard worker can say about the devices it runs on.

A shard worker is started with ``CUDA_VISIBLE_DEVICES`` set to the node-local
indices of its rank's bundle (:mod:`rlix_async.process_plan`). It checks it sees
exactly that many devices before loading anything, reports its global device
ids in its hello (the coordinator refuses a shard whose devices are not its
rank's), and after every sleep and wake reports the memory in use:

- CUDA: bytes in use on its devices, read through NVML (``nvidia-ml-py``,
  which vLLM depends on). NVML needs no CUDA context; ``torch.cuda.mem_get_info``
  would create one in the worker process, and that context (hundreds of MiB per
  device) would stay resident while the shard sleeps. Without NVML it falls back
  to ``torch.cuda.mem_get_info``, at that cost.
- CPU: the resident memory of the worker and its children (vLLM's engine core).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


class DeviceBindingError(RuntimeError):
    """The worker does not see the devices the launcher bound it to."""


def visible_cuda_devices() -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs); empty when unset or empty."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [d.strip() for d in raw.split(",") if d.strip()]


def check_binding(devices: Sequence[int], tp: int, cuda_count: int | None) -> None:
    """A shard bound to ``devices`` must see exactly that many CUDA devices (when it
    runs on CUDA: ``cuda_count`` not None) and have one per tensor-parallel rank."""
    if devices and len(devices) != tp:
        raise DeviceBindingError(
            f"bound to devices {list(devices)} but tensor_parallel_size is {tp}"
        )
    if cuda_count is not None and devices and cuda_count != len(devices):
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")
        raise DeviceBindingError(
            f"bound to devices {list(devices)} but sees {cuda_count} CUDA devices "
            f"(CUDA_VISIBLE_DEVICES={visible}); the launcher sets one entry per device"
        )


def memory_in_use(cuda: bool) -> int:
    """Device memory in use on this worker's devices (CUDA), else its tree's RSS (bytes)."""
    if cuda:
        return _cuda_memory_in_use()
    return _rss_of_tree(os.getpid())


def _cuda_memory_in_use() -> int:
    try:
        import pynvml
    except ImportError:
        import torch

        used = 0
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            used += total - free
        return used
    pynvml.nvmlInit()
    try:
        used = 0
        entries = visible_cuda_devices() or [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        for entry in entries:
            if entry.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
            used += int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        return used
    finally:
        pynvml.nvmlShutdown()


def _rss_of_tree(root: int) -> int:
    """Resident bytes of ``root`` and every descendant, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = text[text.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    page = os.sysconf("SC_PAGE_SIZE")
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        todo += children.get(pid, [])
    return total
