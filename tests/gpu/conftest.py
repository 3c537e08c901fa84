"""The GPU tier: every test here needs a CUDA device and is marked ``gpu``.

CI machines have no GPU and deselect the tier (``-m "not gpu"``). Selected on a
machine without CUDA (``pytest -m gpu``) each test fails with one clear line
instead of skipping, so a GPU run that silently tested nothing cannot pass.
``scripts/gpu-check`` runs the torch-only part and prints the figures that
docs/PERF.md records.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before -m selection and the tier skips of tests/conftest.py
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == HERE:
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True)
def _cuda_required() -> None:
    if not torch.cuda.is_available():
        pytest.fail("the gpu tier needs a CUDA device; this machine has none", pytrace=False)
