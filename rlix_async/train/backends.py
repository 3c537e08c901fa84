"""Trainer backends: what ``train.backend`` names, and the one place a pipeline's
trainer is built from its config.

A backend is an object with the three methods of :class:`TrainerBackend`. The
package's own are registered in :data:`BACKENDS` (``torch``: train/trainer.py,
``megatron``: train/megatron.py); one of your own is named by path in the config,
with no change to the package::

    train:
      backend: custom
      custom: examples/trainers/plain_sgd.py:BACKEND   # or package.module:NAME
      custom_args: {...}                              # read by your build()
      lr: 1.0e-5                                      # the common keys, as for any backend

Adding a backend to the package is a module with its trainer and backend object, one
line in :data:`BACKENDS`, and its section in config/training.py (a member of the
``TrainConfig`` union whose tag is the backend's name).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rlix_async.config import CustomTrainConfig
from rlix_async.user_code import LoadError, load_object

if TYPE_CHECKING:
    import torch.distributed as dist

    from rlix_async.config import PipelineConfig, TrainConfig
    from rlix_async.protocols.trainer import Trainer

# train.backend -> the backend object, by path (imported only when chosen: megatron-core
# is an extra)
BACKENDS = {
    "torch": "rlix_async.train.trainer:BACKEND",
    "megatron": "rlix_async.train.megatron_backend:BACKEND",
}


class TrainerBackendError(ValueError):
    """A backend that cannot be loaded or refuses a pipeline: one line."""


class TrainerBackend(Protocol):
    def build(
        self, cfg: PipelineConfig, rank: int, world: int, store: dist.Store | None
    ) -> Trainer:
        """Rank ``rank`` of ``world``'s trainer for pipeline ``cfg``, in host memory (its
        devices are not the pipeline's before the coordinator's first grant; its first
        ``reload`` moves it there). ``store``: the ranks' store (None: one rank), on
        which a model-parallel backend's ranks meet while they build."""
        ...

    def check(self, cfg: PipelineConfig) -> None:
        """Before any process starts (``rlix-async launch``): raise ValueError, one line,
        for a pipeline this backend cannot train (a model family it would build wrong,
        a layout it lacks)."""
        ...

    def hf_state(self, state: dict[str, Any], base: Path) -> dict[str, Any]:
        """A checkpoint's model as ``save`` wrote it, in the HF names of the model
        directory ``base`` (``rlix-async export``)."""
        ...


def trainer_backend(train: TrainConfig) -> TrainerBackend:
    """The backend ``train`` names (TrainerBackendError: one line, if it cannot load or
    lacks a method)."""
    spec = train.custom if isinstance(train, CustomTrainConfig) else BACKENDS[train.backend]
    try:
        backend = load_object(spec)
    except LoadError as exc:
        raise TrainerBackendError(f"train.custom: {exc}") from None
    missing = [m for m in ("build", "check", "hf_state") if not callable(getattr(backend, m, None))]
    if missing:
        raise TrainerBackendError(
            f"train.custom: {spec} is not a trainer backend (no {', '.join(missing)}: "
            "rlix_async/train/backends.py says what one has)"
        )
    return backend  # type: ignore[no-any-return]


def build_trainer(
    cfg: PipelineConfig, rank: int, world: int, store: dist.Store | None = None
) -> Trainer:
    """This rank's trainer, by its config's backend."""
    return trainer_backend(cfg.train).build(cfg, rank, world, store)
