"""A trainer backend from outside the package: a HF causal LM trained with SGD.

Plugged in by config alone (rlix_async/train/backends.py says what a backend has)::

    train:
      backend: custom
      custom: examples/trainers/sgd_trainer.py:BACKEND
      custom_args: {momentum: 0.9}     # read by this file, nothing else
      lr: 1.0e-2                       # the common keys, as every backend reads them

What it shows: a backend owns how its model is built, optimized, placed on and off the
devices and checkpointed; the GRPO step itself (packing, pi_old, the DAPO/CISPO loss,
micro-batches, gradient clipping) is the package's ``PolicyUpdate``, run over torch DDP
(``DataParallel``), so this file holds only what differs: plain SGD with momentum
instead of AdamW, and float32 weights with no main copies. Copy it to start an FSDP or
JAX backend: the ten members of ``rlix_async.protocols.trainer.Trainer`` are the whole
contract with the pipeline.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlix_async.config import CustomTrainConfig, PipelineConfig
from rlix_async.models.hf import load_hf_model
from rlix_async.models.tiny import tiny_llama
from rlix_async.protocols.batch import Group
from rlix_async.train.checkpoints import read_checkpoint, rng_state, set_rng_state, write_checkpoint
from rlix_async.train.data_parallel import DataParallel
from rlix_async.train.devices import RankPlace
from rlix_async.train.policy_update import PolicyUpdate


class SgdTrainer:
    def __init__(self, cfg: PipelineConfig, rank: int, world: int) -> None:
        train = cfg.train
        assert isinstance(train, CustomTrainConfig)
        self.place = RankPlace.of(rank, world)
        self.device = self.place.device
        # built in host memory: the devices are the pipeline's only once granted
        if cfg.model.path:
            self.model = load_hf_model(cfg.model.path, torch.float32)
        else:
            self.model = tiny_llama(cfg.seed, **cfg.model.tiny)
        self.optim = torch.optim.SGD(
            self.model.parameters(),
            lr=train.lr,
            momentum=float(train.custom_args.get("momentum", 0.0)),
            weight_decay=train.weight_decay,
        )
        self.parallel = DataParallel(
            self.device,
            rank,
            world,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            max_grad_norm=train.max_grad_norm,
        )
        self.update = PolicyUpdate(train, self.parallel, self.device, total_steps=cfg.steps)
        self.step = 0
        self.step_times: dict[str, float] = {}
        self._groups = 0

    def reload(self) -> None:
        self._move(self.device)

    def offload(self) -> None:
        self._move(torch.device("cpu"))  # the devices left empty for the shards

    def _move(self, where: torch.device) -> None:
        if self.device.type == "cpu":
            return  # one memory: nothing to move
        self.model.to(where)
        for state in self.optim.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(where)

    def init_group(self, store: dist.Store | None) -> None:
        if store is None:
            return  # one rank: no group
        self._groups += 1
        dist.init_process_group(
            self.place.backend,
            store=dist.PrefixStore(f"sgd-{self._groups}", store),
            rank=self.place.rank,
            world_size=self.place.world,
        )
        self.parallel.wrap(self.model)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        t0 = time.perf_counter()
        stats = self.update.run(self.model, self.optim, None, groups, self.step)
        self.step += 1
        self.step_times = {**self.update.step_times, "time_sgd_step_s": time.perf_counter() - t0}
        return stats

    def destroy_group(self) -> None:
        self.parallel.unwrap()
        if dist.is_initialized():
            dist.destroy_process_group()

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # the shards tie it again
        return state

    def save(self, path: Path, extra: dict[str, Any]) -> Path:
        state = {
            "model": self.model.state_dict(),
            "optim": self.optim.state_dict(),
            "step": self.step,
            "rng": rng_state(self.device),
        }
        return write_checkpoint(path, {**state, **extra})

    def load(self, path: Path) -> dict[str, Any]:
        ckpt = read_checkpoint(path)
        self.model.load_state_dict(ckpt["model"])
        self.optim.load_state_dict(ckpt["optim"])
        self.step = int(ckpt["step"])
        set_rng_state(ckpt["rng"], self.device)
        return ckpt


class SgdBackend:
    def build(
        self, cfg: PipelineConfig, rank: int, world: int, store: dist.Store | None
    ) -> SgdTrainer:
        return SgdTrainer(cfg, rank, world)

    def check(self, cfg: PipelineConfig) -> None:
        """What this backend cannot train, in one line, before any process starts."""
        spec = cfg.clusters["actor_train"]
        if spec.tp != 1 or spec.pp != 1 or spec.ep != 1:
            raise ValueError("the sgd backend is data parallel only (tp: 1, pp: 1, ep: 1)")
        if cfg.lora is not None:
            raise ValueError("the sgd backend trains full weights (no lora)")
        if cfg.train.loss.kl_coef > 0:
            raise ValueError("the sgd backend keeps no KL reference (loss.kl_coef: 0)")
        momentum = cfg.train.custom_args.get("momentum", 0.0)  # type: ignore[union-attr]
        if not isinstance(momentum, int | float) or not 0 <= momentum < 1:
            raise ValueError(f"train.custom_args.momentum: {momentum!r} is not in [0, 1)")

    def hf_state(self, state: dict[str, Any], base: Path) -> dict[str, Any]:
        return state  # saved in the HF model's own names


BACKEND = SgdBackend()
