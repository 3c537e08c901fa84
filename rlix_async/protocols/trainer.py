"""What the pipeline needs from a trainer, in one place.

Rank 0's driver (``pipeline.py``: ``Driver``) and every other rank's loop
(``pipeline.py``: ``_follower``) use a trainer through these members and no
others, whatever its backend: the torch backend (``train/trainer.py``), the
megatron backend (``train/megatron.py``) or one of your own (``train.backend:
custom``; ``train/backends.py`` says how a backend is named and built, and
``examples/trainers/`` has one that runs).

The time-sharing cycle, per step, on every rank: ``reload`` (the state back onto
the devices the coordinator just granted), ``init_group`` (a fresh collective group
on the ranks' store), ``train_step``, ``destroy_group``, ``offload`` (the devices
left empty). Rank 0 then calls ``weights_for_cache`` (the new version, in the names
the shards' loader takes) and at checkpoint steps ``save``. A trainer is built in
host memory and first reaches its devices at its first ``reload``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from rlix_async.protocols.batch import Group


class Trainer(Protocol):
    step: int  # optimizer steps taken so far: the version the next weights will carry
    step_times: dict[str, float]  # where the last train_step's time went, by part (``time_*_s``)

    def reload(self) -> None:
        """The training state back onto this rank's devices (nothing if it is there)."""
        ...

    def offload(self) -> None:
        """The training state off the devices (into host memory), the devices left
        empty for the shards that time-share them. Only with the group destroyed."""
        ...

    def init_group(self, store: dist.Store | None) -> None:
        """A fresh collective group for this step, met on ``store`` (the pipeline's
        ranks' store; None: running alone, no group)."""
        ...

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One training step on ``groups`` (every rank gets the same batch and takes
        its own share); the step's figures, the same on every rank (loss, grad_norm,
        ...: one row of metrics.jsonl)."""
        ...

    def destroy_group(self) -> None:
        """Tear down what ``init_group`` built."""
        ...

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        """Rank 0: the whole model as the shards load it (HF names, the trainer's dtype),
        to be packed into the host cache; views of host memory where possible."""
        ...

    def save(self, path: Path, extra: dict[str, Any]) -> Path:
        """Rank 0: a checkpoint of this step at ``path`` with ``extra`` (plain values:
        the replay buffer, the collector's state), written whole or not at all;
        returns what was written (a file or a directory)."""
        ...

    def load(self, path: Path) -> dict[str, Any]:
        """Every rank: resume from the checkpoint at ``path`` (``step`` included);
        returns its other entries (``extra`` as saved)."""
        ...
