"""The GPU tier's tools, as they behave on a machine without CUDA (this one): the
check stops at once with one line, and the tier holds the tests the README's GPU
section promises (collected here, run only where a GPU is lent)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_without_cuda_stops_at_once_with_one_line() -> None:
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu-check")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: "), done.stderr
    assert "run it on a GPU machine" in lines[0]
    assert time.monotonic() - t0 < 30


def test_the_gpu_tier_holds_the_promised_tests() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "tests/gpu",
            "--collect-only",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert len(ids) >= 25, len(ids)
    for needed in (
        "test_megatron_gpu.py::test_megatron_offload_empties_the_device_and_reload_restores_it",
        "test_megatron_gpu.py::test_megatron_exports_weights_an_hf_model_runs_with_the_same_logits",
        "test_lora_gpu.py::test_a_lora_step_on_the_device_moves_only_the_adapter",
        "test_vllm_sleep_gpu.py::test_wake_without_weights_then_shrink_frees_what_vllm_holds",
        "test_vllm_sleep_gpu.py::test_sleep_frees_device_memory_and_wake_restores_it[1]",
        "test_vllm_sleep_gpu.py::test_sleep_frees_device_memory_and_wake_restores_it[2]",
        "test_trainer_gpu.py::test_the_pipelines_build_order_copies_from_the_device_into_the_page_locked_slot",
    ):
        assert any(i.endswith(needed) for i in ids), needed
