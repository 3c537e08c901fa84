"""``train.backend: megatron`` (train/backends.py): a pipeline's config to a
:class:`~rlix_async.train.megatron.MegatronTrainer` on each torchrun rank, the layout
checks made at launch before any process starts, and a checkpoint's model in the
base directory's HF names (``export``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from rlix_async.config import MegatronTrainConfig
from rlix_async.train.checkpoints import checkpoint_due, checkpoint_path
from rlix_async.train.megatron import MegatronTrainer
from rlix_async.train.megatron_hf import megatron_to_hf, model_shape
from rlix_async.train.megatron_moe import check_moe_layout

if TYPE_CHECKING:
    from rlix_async.config import PipelineConfig


class MegatronBackend:
    """``train.backend: megatron`` (train/backends.py)."""

    def build(
        self, cfg: PipelineConfig, rank: int, world: int, store: dist.Store | None
    ) -> MegatronTrainer:
        assert isinstance(cfg.train, MegatronTrainConfig)  # the registry's choice
        spec = cfg.clusters["actor_train"]
        # in host memory until the first grant: the devices are not the pipeline's yet
        return MegatronTrainer(
            cfg.train,
            cfg.model,
            tp=spec.tp,
            pp=spec.pp,
            ep=spec.ep,
            store=store,
            checkpoint_to=lambda step: (
                checkpoint_path(cfg.run_dir, step) if checkpoint_due(step, cfg) else None
            ),
            seed=cfg.seed,
            rank=rank,
            world=world,
            start_offloaded=True,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            total_steps=cfg.steps,
        )

    def check(self, cfg: PipelineConfig) -> None:
        """A model directory of a family it would build wrong, or an MoE model at a
        layout not built for it, is refused (one line)."""
        if cfg.model.path:
            spec = cfg.clusters["actor_train"]
            check_moe_layout(model_shape(cfg.model.path).get("moe"), spec.tp, spec.pp, spec.ep)

    def hf_state(self, state: dict[str, Any], base: Path) -> dict[str, Any]:
        """A checkpoint's model, in Megatron's names, in the base's HF names."""
        s = model_shape(str(base))
        return megatron_to_hf(state, s["heads"], s["groups"], s["head_dim"])


BACKEND = MegatronBackend()
