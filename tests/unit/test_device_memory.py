"""What a shard reports as its device memory (shards/devices.py): its own processes'
bytes, not the device's, and counting devices never initialises CUDA."""

from __future__ import annotations

import pytest
import torch

from rlix_async.shards import devices
from rlix_async.shards.devices import cuda_device_count, shard_device_memory

GiB = 1 << 30


def test_only_the_shards_processes_count() -> None:
    # device 0: the shard's engine (pid 11) and a trainer (pid 99); device 1: its worker
    seen = [(40 * GiB, [(11, 10 * GiB), (99, 30 * GiB)]), (12 * GiB, [(12, 12 * GiB)])]
    assert shard_device_memory(seen, {10, 11, 12}) == 22 * GiB


def test_another_pid_namespace_falls_back_to_whole_devices(
    caplog: pytest.LogCaptureFixture,
) -> None:
    devices._whole_device_noted = False
    seen = [(40 * GiB, [(5011, 10 * GiB), (5099, 30 * GiB)])]  # host pids, none ours
    assert shard_device_memory(seen, {10, 11}) == 40 * GiB
    assert "NVML lists none of this shard's processes" in caplog.text
    caplog.clear()
    shard_device_memory(seen, {10, 11})
    assert not caplog.text  # said once


def test_unknown_bytes_of_one_of_ours_fall_back_to_whole_devices() -> None:
    seen = [(40 * GiB, [(11, None), (99, 30 * GiB)])]  # NVML_VALUE_NOT_AVAILABLE
    assert shard_device_memory(seen, {11}) == 40 * GiB


def test_counting_cuda_devices_asks_nvml_not_the_cuda_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch.cuda.is_available() would call cudaGetDeviceCount (cuInit in the shard,
    after which vLLM's forked engine core cannot use CUDA); the count goes through NVML."""
    runtime_calls: list[str] = []

    def runtime_count() -> int:
        runtime_calls.append("cudaGetDeviceCount")
        return 2

    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", runtime_count, raising=False)
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    assert cuda_device_count() == 2
    assert runtime_calls == []
    torch.cuda.is_available()  # what the shard used to call: it reaches the runtime
    assert runtime_calls == ["cudaGetDeviceCount"]
