"""The torch trainer backend: a HF ``LlamaForCausalLM`` under torchrun, DDP over gloo/NCCL.

Time-sharing cycle: the collective group lives only while the
trainer holds its devices. ``reload`` and ``init_group`` before a step (a fresh
group on a prefix of the persistent torchrun store), ``train_step``, then
``destroy_group``, ``offload`` (the whole training state into page-locked host
buffers, the device left empty) and ``weights_for_cache`` (the host copy the
rollout shards sync from) before the stage is released.

Devices: one per rank, ``cuda:{LOCAL_RANK}`` among those the process sees (the
launcher sets ``CUDA_VISIBLE_DEVICES`` to the pipeline's actor_train devices).
Precision: parameters in ``TrainConfig.dtype``; under ``bfloat16`` the optimizer
keeps float32 main weights and moments (``train/precision.py``), under
``bfloat16_pure`` nothing in float32; log-probs, importance ratios, advantages and
the loss always in float32.

LoRA (``lora``, issue 21): the model is a peft model on the frozen base; the optimizer,
DDP's gradient reduction, checkpoints and the weight cache hold the adapter only, and
the KL reference is the base itself (the adapter switched off, no second copy). The
adapter and its optimizer state are float32 (train/lora.py says why).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlix_async.config import ModelConfig, TrainConfig, resolve_dtype
from rlix_async.models.hf import load_hf_model
from rlix_async.train import lora as lora_utils
from rlix_async.train.algo import (
    entropy,
    lr_factor,
    policy_loss,
    sampling_log_softmax,
)
from rlix_async.train.buffer import Group
from rlix_async.train.checkpoints import rng_state, set_rng_state
from rlix_async.train.devices import trainer_device
from rlix_async.train.host_buffers import DeviceOffload, state_tensors
from rlix_async.train.packing import Piece, Take, micro_batches, pack_batch
from rlix_async.train.precision import (
    DTYPES,
    MainParamsAdamW,
    cast_floats,
    cast_parameters,
    drop_main_params,
    needs_main_params,
)
from rlix_async.train.sharded_checkpoint import CheckpointError

if TYPE_CHECKING:
    from rlix_async.config.lora import LoraConfig


class TorchTrainer:
    def __init__(
        self,
        cfg: TrainConfig | None = None,
        model: ModelConfig | None = None,
        *,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        start_offloaded: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        lora: LoraConfig | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.cfg = cfg or TrainConfig()
        self.lora = lora
        # the pipeline's steps: where a linear learning-rate schedule reaches 0
        if self.cfg.lr_schedule == "linear" and not total_steps:
            raise ValueError("lr_schedule linear needs the run's total_steps")
        self.total_steps = total_steps or 0
        # the rollout's sampling: log-probs are of the distribution tokens were drawn from
        self.temperature, self.top_p = temperature, top_p
        self.model_cfg = model or ModelConfig()
        self.seed = seed
        self.rank, self.world = rank, world
        # the replica this rank is and how many share each batch (a tensor-parallel
        # backend has several ranks per replica)
        self.dp_rank, self.dp_world = self._replica(rank, world)
        # torchrun sets both; without them the rank arguments stand in (every rank on this node)
        self.local_rank = int(os.environ.get("LOCAL_RANK", rank))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        self.device = torch.device(
            trainer_device(
                self.local_rank,
                self.local_world,
                cuda_count,
                os.environ.get("CUDA_VISIBLE_DEVICES"),
            )
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before any NCCL group or CUDA allocation
        self.dtype = DTYPES[resolve_dtype(self.cfg.dtype, self.device.type == "cuda")]
        self._ddp: torch.nn.Module | None = None
        self._group_gen = 0  # before the model: a backend may need a group to build it
        # start_offloaded (the pipeline): built in host memory, onto the device at the
        # first reload(), i.e. once the coordinator has granted it
        self.model = self._build_model()
        if lora is not None:  # still in host memory: the adapter is built there
            self.model = lora_utils.lora_model(self.model, lora, seed)
        if not start_offloaded:
            self.model = self.model.to(self.device)
        # fused: one kernel over all parameters instead of a dozen ops per tensor (0.07 s
        # against 0.45 s a step for 135M float32 parameters on one CPU core; the default
        # of transformers' Trainer, so of TRL, too)
        trainable = self._optimized(list(lora_utils.trainable(self.model)))
        self.optim: torch.optim.Optimizer
        if self.cfg.dtype != "bfloat16_pure" and needs_main_params(trainable):
            self.optim = MainParamsAdamW(
                trainable, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, fused=True
            )
        else:
            self.optim = torch.optim.AdamW(
                trainable, lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, fused=True
            )
        # the KL penalty's reference: the starting weights, frozen (a resume rebuilds it
        # from the same start, so checkpoints need not hold it). An adapter's start is
        # its base, which the model holds already: no copy, see _before_update
        self.reference: torch.nn.Module | None = None
        if self.cfg.loss.kl_coef > 0 and lora is None:
            self.reference = self._frozen_copy()
        self.step = 0
        self.step_times: dict[str, float] = {}  # the last train_step's, by part
        self._memory = DeviceOffload(self.device)
        if start_offloaded and self.device.type == "cuda":  # built in host memory
            self._memory.moved = list(state_tensors(self.model, self.optim, self.reference))

    def _replica(self, rank: int, world: int) -> tuple[int, int]:
        """(this rank's replica, how many replicas share each batch)."""
        return rank, world

    def _optimized(self, trainable: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """The parameters this rank's optimizer keeps state for and steps."""
        return trainable

    def _after_optim_step(self) -> None:
        """After each optimizer step (a distributed optimizer sends what it stepped)."""

    def _frozen_copy(self) -> torch.nn.Module:
        """A frozen copy of the policy as it is now, where it is now."""
        return copy.deepcopy(self.model).eval().requires_grad_(False)

    def _build_model(self) -> torch.nn.Module:
        if self.model_cfg.path:
            model = load_hf_model(self.model_cfg.path, self.dtype)
        else:
            from rlix_async.models.tiny import tiny_llama

            model = cast_parameters(tiny_llama(self.seed, **self.model_cfg.tiny), self.dtype)
        if self.cfg.recompute == "full":
            # each decoder layer's activations again in the backward pass; non-reentrant:
            # works under DDP and when the inputs need no grad (a LoRA adapter's base)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        return model

    @property
    def offloaded(self) -> bool:
        return bool(self._memory.moved)

    def _require_on_device(self, what: str) -> None:
        if self._memory.moved:
            raise RuntimeError(f"{what} on an offloaded trainer: call reload() first")

    # --- collective group lifecycle ----------------------------------------------------

    def init_group(self, store: dist.Store | None) -> None:
        """A fresh process group for this step (nothing without a store: running alone)."""
        if store is None:
            return
        self._require_on_device("init_group()")
        self._group_gen += 1
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: the pipeline trains in a worker thread
        dist.init_process_group(
            "nccl" if self.device.type == "cuda" else "gloo",
            store=dist.PrefixStore(f"rlix-pg-{self._group_gen}", store),
            rank=self.rank,
            world_size=self.world,
        )
        self._wrap_ddp()

    def _wrap_ddp(self) -> None:
        frozen = lora_utils.frozen_names(self.model)
        if frozen:
            # DDP broadcasts rank 0's parameters at every wrap, i.e. every step: the
            # frozen base would cross the link each time though every rank loaded the
            # same one (one directory, one seed) and none ever changes it
            torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
                self.model, frozen
            )
        self._ddp = torch.nn.parallel.DistributedDataParallel(
            self.model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            process_group=self._dp_group(),
        )

    def _dp_group(self) -> dist.ProcessGroup | None:
        """The replicas' group (None: the default group)."""
        return None

    def _clip_grads(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The gradients' total norm before clipping, after clipping them to
        ``max_grad_norm`` (torch's rule: scaled by max / (norm + 1e-6) when above)."""
        return torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)

    def forward_logits(
        self, model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None
    ) -> torch.Tensor:
        """Logits [B, positions, V] of the last ``keep`` positions (all when None): the
        output layer and every softmax after it cost in proportion to the positions,
        and a step needs only those that predict response tokens (TRL's
        ``logits_to_keep``)."""
        if keep is None:
            return model(input_ids=ids).logits
        return model(input_ids=ids, logits_to_keep=keep).logits

    def destroy_group(self) -> None:
        if self._ddp is not None:
            self._ddp = None
            # DDP sits in a reference cycle: without a collection its reducer keeps
            # gradient buckets the size of the model on the device after offload
            gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- device memory -----------------------------------------------------------------

    def offload(self) -> None:
        """Free the device for rollout: the training state into page-locked host buffers
        (``host_buffers.DeviceOffload``). On CPU: nothing to do."""
        if self.device.type != "cuda" or self._memory.moved:
            return
        if self._ddp is not None:
            raise RuntimeError("offload() while the process group is up: destroy_group() first")
        self._memory.offload(self.model, self.optim, self.reference)

    def reload(self) -> None:
        """Back onto the device: what offload() moved (a checkpoint loaded meanwhile included)."""
        if self._memory.moved:
            self._memory.reload(self.model, self.optim, self.reference)

    # --- one GRPO step -------------------------------------------------------------------

    def _token_logp(
        self, logits: torch.Tensor, ids: torch.Tensor, width: int, with_entropy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p [B, width] of ``ids``' last ``width`` tokens under the sampling
        distribution (float32 from any logits dtype), from the logits of the ``width`` + 1
        positions before them; with its entropy per position (no gradient) if asked."""
        full = sampling_log_softmax(
            logits[:, :-1], temperature=self.temperature, top_p=self.top_p, keep=ids[:, -width:]
        )
        logp = full.gather(-1, ids[:, -width:].unsqueeze(-1)).squeeze(-1)
        if not with_entropy:
            return logp, None
        with torch.no_grad():
            return logp, entropy(full.detach())

    def _logp(
        self, model: torch.nn.Module, ids: torch.Tensor, width: int | None = None
    ) -> torch.Tensor:
        """log p of ``ids``' last ``width`` tokens (all but the first when None)."""
        width = ids.shape[1] - 1 if width is None else width
        logits = self.forward_logits(model, ids, keep=width + 1)
        return self._token_logp(logits, ids, width)[0]

    def _forward(self, model: torch.nn.Module, pieces: list[Piece]) -> None:
        """Each piece's logits (of its ``ids``' last ``width`` + 1 positions) to its
        ``take``, one piece at a time (callers decide about gradients)."""
        for p in pieces:
            p.take(self.forward_logits(model, p.ids, keep=p.width + 1))

    def _forward_backward(self, model: torch.nn.Module, pieces: list[Piece]) -> None:
        """Each piece's forward pass, its ``take`` (a loss) and the backward pass of it:
        gradients add up over the pieces; under DDP they are reduced once, after the
        last."""
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        for j, p in enumerate(pieces):
            last = j == len(pieces) - 1
            with contextlib.nullcontext() if last or not ddp else model.no_sync():  # type: ignore[operator]
                p.take(self.forward_logits(model, p.ids, keep=p.width + 1)).backward()

    def _grads_averaged(self) -> bool:
        """Whether the replicas' gradients are averaged (DDP) rather than left alone."""
        return self._ddp is not None

    @property
    def has_reference(self) -> bool:
        return self.reference is not None or (self.lora is not None and self.cfg.loss.kl_coef > 0)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One training step: ``cfg.minibatches`` optimizer updates on ``groups``; its
        figures. Where its time went (packing, the pi_old pass, the updates) is in
        ``step_times``."""
        self._require_on_device("train_step()")
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 4)

        share = pack_batch(groups, self.dp_rank, self.dp_world)
        t = {k: v.to(self.device) for k, v in share.items()}
        n = t["ids"].shape[0]
        order = torch.arange(n, device=self.device)
        parts = [p for p in order.chunk(max(1, min(self.cfg.minibatches, n))) if len(p)]
        time_pack = lap()
        # Before the first update the weights are pi_old: that minibatch's old log-probs
        # are its own update pass's (detached), unless dropout makes the two passes differ
        first_is_old = self._passes_agree()
        old, ref, entropy_sum = self._before_update(t, parts, parts[1:] if first_is_old else parts)
        stats: dict[str, float] = {
            "loss": 0.0,
            "clip_frac": 0.0,
            "is_weight_mean": 0.0,
            "entropy": 0.0,  # of the sampling distribution, over response tokens
            "grad_norm": 0.0,  # before clipping, mean over the updates made
            "skipped_updates": 0.0,
            "kl": 0.0,
            "lr": self.cfg.lr * self._lr_factor(0),  # the step's first update's
        }
        self.step_times = {"time_pack_s": time_pack, "time_old_logp_s": lap()}
        for j, idx in enumerate(parts):
            is_old = first_is_old and j == 0
            entropy_sum += self._update(t, idx, old, ref, len(parts), stats, j, is_old)
        stats["entropy"] = entropy_sum / float(t["mask"].sum().clamp(min=1.0))
        # the next step starts from zero_grad: kept, the grads would hold a model's size of
        # device memory and be offloaded and reloaded every cycle for nothing
        self.model.zero_grad(set_to_none=True)
        self.step += 1
        self.step_times["time_update_s"] = lap()
        return stats

    def _lr_factor(self, minibatch: int) -> float:
        updates = self.cfg.minibatches
        return lr_factor(
            self.step * updates + minibatch,
            self.total_steps * updates,
            self.cfg.lr_schedule,
            self.cfg.warmup_steps * updates,
        )

    def _passes_agree(self) -> bool:
        """Whether a train-mode pass computes what an eval-mode one does: no dropout
        anywhere (HF attention's is a config value, LoRA's and others' are modules)."""
        config = getattr(self.model, "config", None)
        if getattr(config, "attention_dropout", 0.0) or getattr(config, "hidden_dropout", 0.0):
            return False
        return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in self.model.modules())

    def _before_update(
        self, t: dict[str, torch.Tensor], parts: list[torch.Tensor], old_parts: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """pi_old (these weights, before the update) on ``old_parts``, the reference's
        log-probs (with a KL penalty) on every part and the summed entropy of the
        sampling distribution over ``old_parts``' response tokens; a minibatch at a time,
        so the [rows, T, vocab] distributions never exist for the whole batch at once.
        In eval mode: an adapter's dropout (train mode only) would make them noisy
        draws instead of the distributions the ratios divide by."""
        self.model.eval()
        old = torch.zeros_like(t["mask"])
        ref = torch.zeros_like(t["mask"]) if self.has_reference else None
        entropy_sum = torch.zeros((), dtype=torch.float64)
        width = t["mask"].shape[1]

        def piece(out: torch.Tensor, idx: torch.Tensor, entropy_too: bool) -> Piece:
            """The rows ``idx``: their log-probs into ``out`` (and their entropy summed)."""
            ids = t["ids"][idx]

            def take(logits: torch.Tensor) -> torch.Tensor:
                out[idx], ent = self._token_logp(logits, ids, width, entropy_too)
                if ent is not None:
                    entropy_sum.add_((ent * t["mask"][idx]).sum().cpu())
                return logits.new_zeros(())

            return Piece(ids, width, take)

        with torch.no_grad():
            if ref is not None:
                if self.lora is not None:  # an adapter's reference: the base, adapter off
                    with lora_utils.base_only(self.model):
                        self._forward(self.model, [piece(ref, i, False) for i in parts])
                else:
                    assert self.reference is not None
                    self._forward(self.reference, [piece(ref, i, False) for i in parts])
            self._forward(self.model, [piece(old, i, True) for i in old_parts])
        self.model.train()
        return old, ref, float(entropy_sum)

    def _update(
        self,
        t: dict[str, torch.Tensor],
        idx: torch.Tensor,
        old: torch.Tensor,
        ref: torch.Tensor | None,
        minibatches: int,
        stats: dict[str, float],
        minibatch: int,
        is_old: bool,
    ) -> float:
        """Optimizer update ``minibatch`` of the step, on the rows ``idx``, its gradients
        accumulated over micro-batches; its figures added to ``stats``. ``is_old``: the
        weights are still pi_old, so the update pass's log-probs are the old ones too
        (and its entropy, returned summed over response tokens, is pi_old's)."""
        model = self._ddp or self.model
        averaged = self._grads_averaged()
        # the minibatch's response tokens over every replica: each token weighs the same
        # whichever replica holds it (averaged gradients: hence the replicas factor)
        tokens = t["mask"][idx].sum()
        if dist.is_initialized() and self.dp_world > 1:
            dist.all_reduce(tokens, group=self._dp_group())
        lengths = t["lengths"].tolist()
        micro = micro_batches(
            idx.tolist(), lengths, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch
        )
        first = t["ids"].shape[1] - 1 - t["mask"].shape[1]  # before the first predicted position
        self.model.zero_grad(set_to_none=True)
        entropy_sum = torch.zeros((), dtype=torch.float64)

        def loss_of(mi: torch.Tensor, ids: torch.Tensor, w: int) -> Take:
            def take(logits: torch.Tensor) -> torch.Tensor:
                logp, ent = self._token_logp(logits, ids, w, is_old)
                if ent is not None:  # pi_old's log-probs and entropy are this pass's
                    old[mi, :w] = logp.detach()
                    entropy_sum.add_((ent * t["mask"][mi, :w]).sum().cpu())
                loss, s = policy_loss(
                    logp,
                    old[mi, :w],
                    t["adv"][mi],
                    t["mask"][mi, :w],
                    self.cfg.loss,
                    behavior_logp=t["behavior"][mi, :w],
                    ref_logp=ref[mi, :w] if ref is not None else None,
                    tokens=tokens / self.dp_world if averaged else tokens,
                )
                share = len(mi) / len(idx) / minibatches
                stats["loss"] += loss.item() / minibatches
                stats["clip_frac"] += s["clip_frac"] * share
                stats["is_weight_mean"] += s["is_weight_mean"] * share
                stats["kl"] += s["kl"] * share
                return loss

            return take

        pieces = []
        for rows in micro:
            mi = torch.tensor(rows, device=self.device)
            # up to this piece's own longest row: the padding after it costs nothing
            w = max(max(lengths[r] for r in rows) - 1 - first, 1)
            ids = t["ids"][mi, : first + 1 + w]
            pieces.append(Piece(ids, w, loss_of(mi, ids, w)))
        self._forward_backward(model, pieces)
        norm = self._clip_grads(list(lora_utils.trainable(self.model)))
        # A non-finite gradient would write NaN into every weight and every later
        # rollout: skip that update and count it. Under DDP the gradients are
        # all-reduced before this, so every rank sees the same norm and skips alike.
        if torch.isfinite(norm):
            for group in self.optim.param_groups:
                group["lr"] = self.cfg.lr * self._lr_factor(minibatch)
            self.optim.step()
            self._after_optim_step()
            stats["grad_norm"] += float(norm) / minibatches
        else:
            stats["skipped_updates"] += 1
        return float(entropy_sum)

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        """HF names, as vLLM's ``load_weights`` expects them, in the trainer's dtype.

        After ``offload`` these are views of the page-locked host buffers (no copy).
        A tied ``lm_head.weight`` is left out: it is the embedding (vLLM's loader skips
        it too), and sending it would move the largest matrix twice.
        With LoRA: the adapter only, in the shards' format (train/lora.py).
        """
        if self.lora is not None:
            return lora_utils.adapter_for_cache(self.model, self.dtype)
        state = self.model.state_dict()
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return cast_floats(state, self.dtype)

    # --- checkpoint ------------------------------------------------------------------------

    def save(self, path: Path, extra: dict[str, Any]) -> Path:
        """Model, optimizer, step and RNG, with ``extra``: plain values only (lists,
        dicts, numbers, strings, tensors), what ``load`` accepts; returns the path
        written. With LoRA, "model" is the adapter alone and "lora" says what it was
        trained on (base directory, config, dtype): the frozen base is never written."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        if self.lora is not None:
            model_state = lora_utils.adapter_state(self.model)
            extra = {
                **extra,
                "lora": lora_utils.record(self.lora, self.model_cfg.path, self.dtype),
            }
        else:
            model_state = self._model_state()
        torch.save(
            {
                "model": model_state,
                "optim": self._optim_state(),
                "step": self.step,
                "rng": rng_state(self.device),
                **extra,
            },
            tmp,
        )
        os.replace(tmp, path)  # a kill mid-save never leaves a torn checkpoint
        return path

    def load(self, path: Path) -> dict[str, Any]:
        """The checkpoint at ``path``, installed; its other entries (buffer, collector
        state) returned. Read with ``weights_only``: tensors, containers and plain
        values only, so a file we did not write cannot run code as it is read."""
        if path.is_dir():
            raise CheckpointError(
                f"{path}: a sharded checkpoint (written by a model-parallel megatron "
                "trainer): resume it with train.backend: megatron"
            )
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        self._load_model(path, ckpt)
        self._load_optim(ckpt["optim"])
        self._resume_at(ckpt["step"], ckpt["rng"])
        return ckpt

    def _resume_at(self, step: int, rng: dict[str, Any]) -> None:
        """After a checkpoint's model and optimizer state are in: its step and RNG (main
        weights it holds dropped when this run trains without them)."""
        if not isinstance(self.optim, MainParamsAdamW):
            drop_main_params(self.optim)
        self.step = int(step)
        set_rng_state(rng, self.device)

    def _model_state(self) -> dict[str, Any]:
        """The model's state as a checkpoint keeps it."""
        return self.model.state_dict()

    def _optim_state(self) -> dict[str, Any]:
        """The optimizer's state as a checkpoint keeps it."""
        return self.optim.state_dict()

    def _load_optim(self, state: dict[str, Any]) -> None:
        self.optim.load_state_dict(state)

    def _load_model(self, path: Path, ckpt: dict[str, Any]) -> None:
        if self.lora is not None or "lora" in ckpt:  # either: a mismatch is refused there
            lora_utils.load_checkpoint_adapter(self.model, self.lora, ckpt, path)
        else:
            self.model.load_state_dict(ckpt["model"])
