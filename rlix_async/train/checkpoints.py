"""A run's checkpoints: ``ckpt/step_N.pt`` files and sharded ``ckpt/step_N/``
directories (train/sharded_checkpoint.py), found, ordered and pruned; and the random
state a checkpoint carries so a resumed run draws what the uninterrupted one would have."""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlix_async.config import PipelineConfig
from rlix_async.train.sharded_checkpoint import CheckpointError, is_sharded


def rng_state(device: torch.device) -> dict[str, Any]:
    """The host generators' states and this rank's device generator's (dropout,
    sampling in a custom loss)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """What :func:`rng_state` saved, restored (the device's only on a device)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


def write_checkpoint(path: Path, state: dict[str, Any]) -> Path:
    """``state`` (tensors, containers and plain values only: what :func:`read_checkpoint`
    accepts) to the file ``path``, whole or not at all: a kill mid-save never leaves a
    torn checkpoint. Returns ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    return path


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A checkpoint file, read with ``weights_only``: tensors, containers and plain
    values only, so a file we did not write cannot run code as it is read. A sharded
    checkpoint (a directory) is refused, naming the backend that writes them."""
    if path.is_dir():
        raise CheckpointError(
            f"{path}: a sharded checkpoint (written by a model-parallel megatron "
            "trainer): resume it with train.backend: megatron"
        )
    ckpt: dict[str, Any] = torch.load(path, map_location="cpu", weights_only=True)
    return ckpt


def checkpoint_step(path: Path) -> int | None:
    """N of a checkpoint named ``step_N.pt`` or ``step_N`` (None: another name, e.g. a
    file or directory still being written)."""
    m = re.fullmatch(r"step_(\d+)(\.pt)?", path.name)
    return int(m.group(1)) if m else None


def checkpoints(directory: Path) -> list[Path]:
    """``step_N.pt`` files and sharded ``step_N`` directories, oldest step first."""
    found = [
        p
        for p in directory.glob("step_*")
        if checkpoint_step(p) is not None and (p.is_file() or is_sharded(p))
    ]
    return sorted(found, key=lambda p: checkpoint_step(p) or 0)


def latest_checkpoint(directory: Path) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def prune_checkpoints(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints; returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    old = checkpoints(directory)[:-keep]
    for path in old:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return old


def checkpoint_path(run_dir: Path, step: int) -> Path:
    """Where step ``step``'s checkpoint is saved (a model-parallel megatron trainer
    writes the directory ``step_N`` instead, train/sharded_checkpoint.py)."""
    return run_dir / "ckpt" / f"step_{step}.pt"


def checkpoint_due(step: int, cfg: PipelineConfig) -> bool:
    """Whether the run checkpoints after training step ``step`` (counted from 1)."""
    return step % cfg.checkpoint_every == 0 or step == cfg.steps


def same_resume_step(store: dist.Store, rank: int, step: int) -> None:
    """Every rank resumed from the same step (a rank on a node that cannot read rank
    0's checkpoint directory would train from another state)."""
    if rank == 0:
        store.set("resume/step", str(step))
        return
    theirs = int(store.get("resume/step"))
    if theirs != step:
        raise RuntimeError(
            f"rank {rank} resumed at step {step} but rank 0 at step {theirs}: every node of "
            "a trainer must read the same checkpoint directory (out on a shared file system)"
        )
