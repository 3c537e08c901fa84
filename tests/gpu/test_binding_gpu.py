"""Binding on a real GPU machine: every process of a launch plan sees exactly its
devices, a shard that sees the wrong number refuses to start, and a shard's memory
report moves with what its devices hold. (Never run yet: no GPU machine has run this
project's tier; docs/PERF.md says so until one does.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from rlix_async.config import LaunchConfig, convert
from rlix_async.process_plan import build_plan
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
    return build_plan(cfg, tmp_path, "ipc:///unused")


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
            "model=/unused",
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


def _base_env() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env
