"""What a shard worker can say about the devices it runs on.

A shard worker is started with ``CUDA_VISIBLE_DEVICES`` set to the node-local
indices of its rank's bundle (:mod:`rlix_async.placement`). It checks it sees
exactly that many devices before loading anything, reports its global device
ids in its hello (the coordinator refuses a shard whose devices are not its
rank's), and after every sleep and wake reports the memory in use:

- CUDA: bytes that the worker and its children (vLLM's engine core and its
  tensor-parallel workers) hold on its devices, read through NVML
  (``nvidia-ml-py``, which vLLM depends on): per process, so a shard sharing a
  device with a trainer or another pipeline's shard reports only its own. NVML
  needs no CUDA context; ``torch.cuda.mem_get_info`` would create one in the
  worker process, and that context (hundreds of MiB per device) would stay
  resident while the shard sleeps. Where NVML cannot tell processes apart (a
  container with its own pid namespace lists host pids) the report is the whole
  devices' use, and says so once in the log. Without NVML it falls back to
  ``torch.cuda.mem_get_info`` (whole devices), at that cost.
- CPU: the resident memory of the worker and its children (vLLM's engine core).

Counting devices never initialises CUDA in the worker (:func:`cuda_device_count`):
vLLM starts its engine core by fork unless CUDA is initialised in the parent, and a
child forked after ``cuInit`` cannot use CUDA.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)


class DeviceBindingError(RuntimeError):
    """The worker does not see the devices the launcher bound it to."""


def visible_cuda_devices() -> list[str]:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs); empty when unset or empty."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    return [d.strip() for d in raw.split(",") if d.strip()]


def cuda_device_count() -> int:
    """CUDA devices this process sees, counted without initialising CUDA here.

    ``torch.cuda.is_available()`` asks the CUDA runtime (``cudaGetDeviceCount``,
    which runs ``cuInit`` in this process) unless ``PYTORCH_NVML_BASED_CUDA_CHECK=1``;
    vLLM then still forks its engine core, because it decides from
    ``torch.cuda.is_initialized()``, which stays False, and the forked child's first
    CUDA call fails. ``torch.cuda.device_count()`` counts through NVML (honouring
    ``CUDA_VISIBLE_DEVICES``) and asks the runtime only where NVML does not answer.
    """
    import torch

    if not torch.backends.cuda.is_built():
        return 0
    return int(torch.cuda.device_count())


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
    """Memory this worker's process tree holds: on its CUDA devices, else resident (bytes)."""
    if cuda:
        return _cuda_memory_in_use()
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for pid in process_tree(os.getpid()):
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):  # ended while we looked
            continue
    return total


_whole_device_noted = False


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
        entries = visible_cuda_devices() or [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
        devices: list[tuple[int, list[tuple[int, int | None]]]] = []
        for entry in entries:
            if entry.isdigit():
                handle = pynvml.nvmlDeviceGetHandleByIndex(int(entry))
            else:
                handle = pynvml.nvmlDeviceGetHandleByUUID(entry)
            procs = [
                (int(p.pid), p.usedGpuMemory)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            ]
            devices.append((int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), procs))
        return shard_device_memory(devices, process_tree(os.getpid()))
    finally:
        pynvml.nvmlShutdown()


def shard_device_memory(
    devices: Sequence[tuple[int, Sequence[tuple[int, int | None]]]], tree: set[int]
) -> int:
    """What the processes of ``tree`` hold over ``devices``: per device (its whole use,
    and (pid, bytes) for each process NVML lists on it), the bytes of our processes.
    Where NVML lists none of ours on any device (another pid namespace: a container
    sees host pids) or cannot say a process's bytes, each device's whole use counts."""
    global _whole_device_noted
    ours = [[b for pid, b in procs if pid in tree] for _, procs in devices]
    if any(ours) and all(b is not None for own in ours for b in own):
        return sum(b or 0 for own in ours for b in own)
    listed = any(procs for _, procs in devices)
    if listed and not _whole_device_noted:
        _whole_device_noted = True
        log.warning(
            "NVML lists none of this shard's processes (another pid namespace?): its "
            "memory is reported as its devices' whole use"
        )
    return sum(whole for whole, _ in devices)


def process_tree(root: int) -> set[int]:
    """``root`` and every descendant, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the process ended while we looked
            continue
        fields = text[text.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        tree.add(pid)
        todo += children.get(pid, [])
    return tree
