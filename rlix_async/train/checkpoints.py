"""A run's checkpoint files: ``ckpt/step_N.pt``, found, ordered and pruned."""

from __future__ import annotations

from pathlib import Path


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
