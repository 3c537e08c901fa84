"""Run tests/helpers/megatron_tp.py under torchrun and read what rank 0 recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

SCRIPT = Path(__file__).parent / "megatron_tp.py"


def run_tp(
    out: Path,
    model: Path,
    tp: int,
    world: int,
    steps: int,
    ckpt: Path | None = None,
    *,
    pp: int = 1,
    ep: int = 1,
    cuda: bool = False,
    distributed_optimizer: bool = False,
    top_p: float = 1.0,
) -> dict[str, Any]:
    """``world`` ranks at tensor parallel ``tp`` and pipeline parallel ``pp``
    (``cuda``: one device per rank, NCCL; else every device hidden, gloo). The record
    has each rank's ``rss`` (what OUT/rss-RANK.json holds) too."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["RLIX_DISTRIBUTED_OPTIMIZER"] = "1" if distributed_optimizer else "0"
    env["RLIX_TOP_P"] = str(top_p)
    env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(world))) if cuda else ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(SCRIPT), str(out), str(model), f"{tp}x{pp}x{ep}", str(steps)]  # fmt: skip
    done = subprocess.run(
        [*cmd, *([str(ckpt)] if ckpt else [])], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return _record(out, world)


def run_jobs(root: Path, world: int, jobs: dict[str, dict[str, Any]]) -> dict[str, dict]:
    """Several runs of ``world`` ranks in turn under one torchrun (on the CPU): each
    job is ``model``, ``tp``, ``steps`` and optionally ``pp``, ``ckpt`` (a path),
    ``distributed_optimizer`` and ``top_p``; its output lands in ROOT/NAME. One start
    and one Megatron import for them all: a start costs more than a tiny run's steps."""
    listed = [{"out": str(root / name), **{k: str(v) if isinstance(v, Path) else v
                                            for k, v in job.items()}}
              for name, job in jobs.items()]  # fmt: skip
    root.mkdir(parents=True, exist_ok=True)
    spec = root / f"jobs-{world}-{next(iter(jobs))}.json"
    spec.write_text(json.dumps(listed))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={world}", str(SCRIPT), "--jobs", str(spec)]  # fmt: skip
    timeout = 120 + 60 * len(jobs)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: _record(root / name, world) for name in jobs}


def _record(out: Path, world: int) -> dict[str, Any]:
    record: dict[str, Any] = torch.load(out / "run.pt", weights_only=True)
    record["logits"] = torch.load(out / "logits.pt", weights_only=True)
    record["rss"] = [json.loads((out / f"rss-{r}.json").read_text()) for r in range(world)]
    return record


LR, STEPS = 1e-3, 2  # the helper's learning rate, and the most steps a compared run takes


def assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The weights two layouts reached from the same start agree. AdamW divides each
    gradient element by its own running magnitude, so an element whose gradient is at
    rounding level moves by up to lr a step in a direction the summation order
    decides: every element within that bound (2 x lr x steps apart), and all but one
    in a thousand within float32 agreement (1e-5 absolute, 1e-4 relative)."""
    assert got.keys() == want.keys()
    for k, v in want.items():
        diff = (got[k].float() - v.float()).abs()
        assert float(diff.max()) <= 2 * LR * STEPS, k
        off = int((diff > 1e-5 + 1e-4 * v.float().abs()).sum())
        assert off <= max(1, v.numel() // 1000), (k, off, float(diff.max()))


def assert_same_training(
    one: dict[str, Any], other: dict[str, Any], clip_frac: bool = False
) -> None:
    """Two layouts' runs from the same HF weights trained alike: the same starting cache
    bit for bit, logits, each step's loss, gradient norm and entropy (and, with
    ``clip_frac``, clipped fraction) to float32 agreement over another summation
    order, the weights after the steps (:func:`assert_same_weights`)."""
    import pytest

    assert one["cache_start"].keys() == other["cache_start"].keys()
    for k, v in one["cache_start"].items():
        assert torch.equal(other["cache_start"][k], v), k
    torch.testing.assert_close(other["logits"], one["logits"], atol=1e-5, rtol=1e-5)
    for a, b in zip(one["figures"], other["figures"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-4)
        if clip_frac:
            assert b["clip_frac"] == pytest.approx(a["clip_frac"], abs=1e-6)
    assert_same_weights(other["cache_end"], one["cache_end"])  # after the steps (lr 1e-3)
