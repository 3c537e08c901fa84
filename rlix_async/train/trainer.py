"""The torch trainer backend: a HF ``LlamaForCausalLM`` under torchrun, DDP over gloo/NCCL.

Time-sharing cycle (seed 000): the collective group lives only while the
trainer holds its devices. ``init_group`` before a step (a fresh group on a
prefix of the persistent torchrun store), ``train_step``, then
``weights_for_cache`` (the host copy the rollout shards sync from),
``offload`` and ``destroy_group`` before the stage is released.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlix_async.config import ModelConfig, TrainConfig
from rlix_async.train.algo import group_advantages, policy_loss, token_log_probs
from rlix_async.train.buffer import Group


class TorchTrainer:
    def __init__(
        self,
        cfg: TrainConfig | None = None,
        model: ModelConfig | None = None,
        *,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.cfg = cfg or TrainConfig()
        self.model_cfg = model or ModelConfig()
        self.seed = seed
        self.rank, self.world = rank, world
        self.device = (
            torch.device(f"cuda:{rank % torch.cuda.device_count()}")
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
        self._ddp: torch.nn.Module | None = None
        self._group_gen = 0  # before the model: a backend may need a group to build it
        self.model = self._build_model().to(self.device)
        self.optim = torch.optim.AdamW(
            self.model.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay
        )
        self.step = 0

    def _build_model(self) -> torch.nn.Module:
        if self.model_cfg.path:
            import transformers

            return transformers.AutoModelForCausalLM.from_pretrained(
                self.model_cfg.path, torch_dtype=torch.float32
            )
        from rlix_async.models.tiny import tiny_llama

        return tiny_llama(self.seed, **self.model_cfg.tiny)

    # --- collective group lifecycle ----------------------------------------------------

    def init_group(self, store: dist.Store | None) -> None:
        """A fresh process group for this step (nothing when running alone)."""
        if self.world == 1 or store is None:
            return
        self._group_gen += 1
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"rlix-pg-{self._group_gen}", store),
            rank=self.rank,
            world_size=self.world,
        )
        self._ddp = torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
        )

    def forward_logits(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits

    def destroy_group(self) -> None:
        self._ddp = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def offload(self) -> None:
        """Free the devices for rollout: model and optimizer state to host memory."""
        if self.device.type != "cuda":
            return  # already in host memory
        self.model.to("cpu")
        for state in self.optim.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to("cpu")
        torch.cuda.empty_cache()

    def reload(self) -> None:
        if self.device.type != "cuda":
            return
        self.model.to(self.device)
        for state in self.optim.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to(self.device)

    # --- one GRPO step -------------------------------------------------------------------

    def _tensors(self, groups: list[Group]) -> dict[str, torch.Tensor]:
        """Pack this rank's share of the batch: prompt + response, left-aligned, padded."""
        rows: list[tuple[list[int], int, list[float], float]] = []
        for g in groups:
            adv = group_advantages(torch.tensor(g.rewards, dtype=torch.float32))
            for resp, lps, a in zip(g.responses, g.logprobs, adv.tolist(), strict=True):
                rows.append((g.prompt + resp, len(g.prompt), lps, a))
        rows = rows[self.rank :: self.world]
        longest = max(len(r[0]) for r in rows)
        n = len(rows)
        ids = torch.zeros(n, longest, dtype=torch.long)
        mask = torch.zeros(n, longest - 1)
        behavior = torch.zeros(n, longest - 1)
        adv = torch.tensor([r[3] for r in rows])
        for i, (seq, plen, lps, _) in enumerate(rows):
            ids[i, : len(seq)] = torch.tensor(seq)
            # position t predicts token t+1: responses start at plen
            mask[i, plen - 1 : len(seq) - 1] = 1.0
            behavior[i, plen - 1 : len(seq) - 1] = torch.tensor(lps)
        return {
            k: v.to(self.device)
            for k, v in dict(ids=ids, mask=mask, behavior=behavior, adv=adv).items()
        }

    def _logp(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        logits = self.forward_logits(model, ids)[:, :-1]
        return token_log_probs(logits, ids[:, 1:])

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        t = self._tensors(groups)
        model = self._ddp or self.model
        self.model.train()
        with torch.no_grad():
            old = self._logp(self.model, t["ids"])  # pi_old: these weights, before the update
        n = t["ids"].shape[0]
        parts = [p for p in torch.arange(n).chunk(max(1, min(self.cfg.minibatches, n))) if len(p)]
        stats: dict[str, float] = {"loss": 0.0, "clip_frac": 0.0, "is_weight_mean": 0.0}
        for idx in parts:
            logp = self._logp(model, t["ids"][idx])
            loss, s = policy_loss(
                logp,
                old[idx],
                t["adv"][idx],
                t["mask"][idx],
                self.cfg.loss,
                behavior_logp=t["behavior"][idx],
            )
            self.optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)
            self.optim.step()
            stats["loss"] += loss.item() / len(parts)
            stats["clip_frac"] += s["clip_frac"] / len(parts)
            stats["is_weight_mean"] += s["is_weight_mean"] / len(parts)
        self.step += 1
        return stats

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        """HF names, as vLLM's ``load_weights`` expects them."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    # --- checkpoint ------------------------------------------------------------------------

    def save(self, path: Path, extra: dict[str, Any]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(
            {
                "model": self.model.state_dict(),
                "optim": self.optim.state_dict(),
                "step": self.step,
                "rng": {
                    "torch": torch.get_rng_state(),
                    "python": random.getstate(),
                },
                **extra,
            },
            tmp,
        )
        os.replace(tmp, path)  # a kill mid-save never leaves a torn checkpoint

    def load(self, path: Path) -> dict[str, Any]:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(ckpt["model"])
        self.optim.load_state_dict(ckpt["optim"])
        self.step = int(ckpt["step"])
        torch.set_rng_state(ckpt["rng"]["torch"])
        random.setstate(ckpt["rng"]["python"])
        return ckpt


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(directory.glob("step_*.pt"), key=lambda p: int(p.stem.split("_")[1]))
    return found[-1] if found else None
