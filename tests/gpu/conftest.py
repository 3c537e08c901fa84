"""The GPU tier: every test here needs a CUDA device and is marked ``gpu``.

CI machines have no GPU and deselect the tier (``-m "not gpu"``). Selected on a
machine without CUDA (``pytest -m gpu``) each test fails with one clear line
instead of skipping, so a GPU run that silently tested nothing cannot pass. A test
whose dependency is missing fails with the reason (no ``importorskip``), with two
exceptions, each under its own marker and reported as not run, with the reason, by
``scripts/gpu-check``:

- ``gpu_vllm``: needs vLLM built for CUDA (too large to carry to a machine without
  a network; the CPU build does not count);
- ``gpu2``: needs two CUDA devices.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

# This process initialises CUDA (the trainer tests): vLLM engines built in it must
# start their processes by spawn (a forked child cannot use CUDA), and asking whether
# CUDA is there must not initialise it (shards/devices.py, cuda_device_count).
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import pytest
import torch

HERE = Path(__file__).parent


def vllm_for_cuda() -> str | None:
    """Why vLLM for CUDA is not here (None: it is)."""
    if importlib.util.find_spec("vllm") is None:
        return "not run: no vLLM installed"
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return "not run: the installed vLLM is not built for CUDA"
    return None


@pytest.hookimpl(tryfirst=True)  # before -m selection and the tier skips of tests/conftest.py
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [item for item in items if Path(str(item.fspath)).parent == HERE]
    for item in mine:
        item.add_marker(pytest.mark.gpu)
    selected = config.option.markexpr and "gpu" in config.option.markexpr
    if not selected or not torch.cuda.is_available():
        return  # without CUDA every test fails in _cuda_required, with its line
    missing_vllm = vllm_for_cuda() if any("gpu_vllm" in i.keywords for i in mine) else None
    two = torch.cuda.device_count() >= 2
    for item in mine:
        if "gpu_vllm" in item.keywords and missing_vllm:
            item.add_marker(pytest.mark.skip(reason=missing_vllm))
        elif "gpu2" in item.keywords and not two:
            item.add_marker(
                pytest.mark.skip(
                    reason=f"not run: needs two CUDA devices, this machine has "
                    f"{torch.cuda.device_count()}"
                )
            )


@pytest.fixture(autouse=True)
def _cuda_required() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs a CUDA device; this machine has none", pytrace=False)
