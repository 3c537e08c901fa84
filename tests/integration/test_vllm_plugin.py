"""vLLM finds our weight-transfer backend in every process it starts: the
``vllm.general_plugins`` entry point in pyproject.toml names
``rlix_async.shards.vllm.plugin:register``, and an installed package's metadata must
agree with it (a stale install, made before the vLLM code moved into shards/vllm/,
would name a module that no longer exists and every sync would fail in the engine core).

A fresh interpreter stands in for vLLM's engine-core process: it loads the general
plugins as that process does, then asks vLLM's own factory for the backend class.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_installed_entry_point_is_the_one_pyproject_declares() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    want = declared["vllm.general_plugins"]["rlix_shm"]
    (installed,) = [
        e
        for e in importlib.metadata.entry_points(group="vllm.general_plugins")
        if e.name == "rlix_shm"
    ]
    assert installed.value == want == "rlix_async.shards.vllm.plugin:register"
    assert callable(installed.load())  # its module imports (no vLLM needed for that)


@pytest.mark.vllm
@pytest.mark.timeout(180)
def test_a_fresh_vllm_process_loads_the_rlix_shm_backend_through_the_entry_point() -> None:
    pytest.importorskip("vllm")
    probe = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.distributed.weight_transfer import WeightTransferEngineFactory as F\n"
        "cls = F._registry['rlix_shm']()\n"  # the lazy loader vLLM calls at engine start
        "print(cls.__module__, cls.__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=170
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["rlix_async.shards.vllm.transfer", "RlixShmTransferEngine"]
