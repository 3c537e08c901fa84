"""A run's checkpoint files: ``ckpt/step_N.pt``, found, ordered and pruned; and the
random state a checkpoint carries so a resumed run draws what the uninterrupted one
would have."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch


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


def checkpoints(directory: Path) -> list[Path]:
    """``step_N.pt`` files, oldest step first."""
    return sorted(directory.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))


def latest_checkpoint(directory: Path) -> Path | None:
    found = checkpoints(directory)
    return found[-1] if found else None


def prune_checkpoints(directory: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints; returns what was deleted."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    old = checkpoints(directory)[:-keep]
    for path in old:
        path.unlink(missing_ok=True)
    return old
