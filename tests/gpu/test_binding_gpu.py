"""Binding on a real GPU machine: every process of a launch plan sees exactly its
devices, a shard that sees the wrong number refuses to start, and a shard's memory
report moves with what its devices hold. (Never run yet: no GPU machine has run this
project's tier; docs/PERF.md says so until one does.)"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import torch

from rlix_async.config import LaunchConfig, convert
from rlix_async.placement import place_processes
from rlix_async.shards.devices import memory_in_use


def _plan_for_this_machine(tmp_path: Path) -> list:  # type: ignore[type-arg]
    n = torch.cuda.device_count()
    infer = list(range(n))
    cfg = convert(
        {
            "cluster": {"nodes": 1, "gpus_per_node": n},
            "pipelines": [
                {
                    "id": "p",
                    "model": {"path": "/unused"},
                    "clusters": {
                        "actor_train": {"tp": 1, "devices": [n - 1]},
                        "actor_infer": {"tp": 1, "devices": infer},
                    },
                }
            ],
        },
        LaunchConfig,
        "test",
    )
    return place_processes(cfg, tmp_path, "ipc:///unused")


def test_every_planned_process_sees_exactly_its_devices(tmp_path: Path) -> None:
    probe = "import torch; print(torch.cuda.device_count())"
    for proc in _plan_for_this_machine(tmp_path):
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={**_base_env(), **proc.env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert int(out.stdout) == len(proc.devices), (proc.role, proc.devices, proc.env)


def test_a_shard_that_sees_the_wrong_devices_refuses_to_start(tmp_path: Path) -> None:
    """Bound to two devices (tp 2) but shown one: exit 2 before any engine loads."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlix_async.cli",
            "shard",
            "pipeline=p",
            "rank=0",
            f"model={tmp_path}",  # a directory: never read, the devices are refused first
            "devices=[0, 1]",
            "tensor_parallel_size=2",
        ],
        env={**_base_env(), "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "bound to devices [0, 1] but sees 1 CUDA devices" in out.stderr


def test_the_memory_report_follows_device_allocations() -> None:
    before = memory_in_use(cuda=True)
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    during = memory_in_use(cuda=True)
    del block
    torch.cuda.empty_cache()
    after = memory_in_use(cuda=True)
    assert during - before >= 0.9 * (1 << 30)
    assert during - after >= 0.9 * (1 << 30)


FORK_PROBE = r"""
import os, torch
from rlix_async.shards.devices import cuda_device_count
n = cuda_device_count()
assert n >= 1 and not torch.cuda.is_initialized(), n
pid = os.fork()
if pid == 0:  # as vLLM forks its engine core after the shard counted its devices
    try:
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
        os._exit(0)
    except BaseException as exc:
        print("child:", exc, flush=True)
        os._exit(1)
_, status = os.waitpid(pid, 0)
print("CHILD", os.waitstatus_to_exitcode(status))
"""


def test_counting_devices_leaves_cuda_to_a_forked_child() -> None:
    """The shard's device check: a child forked after it (vLLM's engine core) uses CUDA."""
    out = subprocess.run(
        [sys.executable, "-c", FORK_PROBE],
        env={k: v for k, v in _base_env().items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "CHILD 0" in out.stdout, out.stdout


HOLD = r"""
import sys, time, torch
block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("HELD", flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_the_memory_report_counts_only_the_shards_own_processes(tmp_path: Path) -> None:
    """Another process (not a descendant: a trainer, another pipeline's shard) holding
    1 GiB on the same device does not show in this process tree's report."""
    import os

    import pynvml

    from rlix_async.shards.devices import process_tree

    torch.zeros(1, device="cuda")  # this process holds a context: NVML lists it
    before = memory_in_use(cuda=True)
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    log = tmp_path / "hold.log"
    # through a shell that exits at once: the holder's parent becomes init
    subprocess.run(
        ["bash", "-c", f"{sys.executable} {script} 30 > {log} 2>&1 &"], check=True, timeout=30
    )
    deadline = time.monotonic() + 60
    while "HELD" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
        time.sleep(0.2)
    during = memory_in_use(cuda=True)
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        listed = {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    finally:
        pynvml.nvmlShutdown()
    if listed & process_tree(os.getpid()):
        assert during - before < 256 << 20, (before, during)  # the other's GiB is not ours
    else:  # NVML lists host pids (a container): the report falls back to the whole device
        print(f"NVML lists no pid of this process tree ({sorted(listed)}): whole-device report")
        assert during - before >= 0.9 * (1 << 30), (before, during)


def test_a_launch_inside_a_restricted_environment_uses_only_its_devices(tmp_path: Path) -> None:
    """CUDA_VISIBLE_DEVICES set by SLURM or the user (here: the last device, by UUID):
    the plan's processes get entries of that list only, and see that device."""
    from rlix_async.placement import bind_visible_devices

    last = torch.cuda.device_count() - 1
    uuid = "GPU-" + str(torch.cuda.get_device_properties(last).uuid)
    cfg = convert(
        {
            "cluster": {"nodes": 1, "gpus_per_node": 1},
            "pipelines": [
                {
                    "id": "p",
                    "model": {"path": "/unused"},
                    "clusters": {
                        "actor_train": {"tp": 1, "devices": [0]},
                        "actor_infer": {"tp": 1, "devices": [0]},
                    },
                }
            ],
        },
        LaunchConfig,
        "test",
    )
    plan = place_processes(cfg, tmp_path, "ipc:///unused")
    bind_visible_devices(plan, {"CUDA_VISIBLE_DEVICES": uuid})
    probe = (
        "import torch; print(torch.cuda.device_count(), torch.cuda.get_device_properties(0).uuid)"
    )
    for proc in plan:
        if not proc.devices:
            continue
        assert proc.env["CUDA_VISIBLE_DEVICES"] == uuid
        assert proc.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        out = subprocess.run(
            [sys.executable, "-c", probe],
            env={**_base_env(), **proc.env},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        count, seen = out.stdout.split()
        assert count == "1" and "GPU-" + seen == uuid


def _base_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env
