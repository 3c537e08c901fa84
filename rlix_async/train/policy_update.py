"""One GRPO training step, the same for every trainer backend.

A step packs this replica's share of the batch (``train/packing.py``), computes pi_old
(and the KL reference's log-probs) a minibatch at a time, then makes
``cfg.minibatches`` optimizer updates, each accumulating gradients over micro-batches
(the policy loss of ``train/algo.py``), clipping them and skipping an update whose
gradient is not finite. What depends on how a backend splits its model over ranks
(how pieces go forward and backward, where the logits' vocabulary lives, how the
gradients of replicas meet and how their norm is taken) is a :class:`ModelParallel`
the backend gives :class:`PolicyUpdate`: ``DataParallel`` for the torch backend
(``train/data_parallel.py``), ``MegatronParallel`` for megatron's tensor x pipeline x
data layout (``train/megatron_parallel.py``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist

from rlix_async.train import lora as lora_utils
from rlix_async.train.algo import entropy, lr_factor, policy_loss, sampling_log_softmax
from rlix_async.train.packing import Piece, Take, micro_batches, minibatch_rows, pack_batch

if TYPE_CHECKING:
    from rlix_async.config.training import TrainSection
    from rlix_async.protocols.batch import Group


class ModelParallel(Protocol):
    """How a backend runs its model over its ranks, as a training step needs it."""

    dp_rank: int  # this rank's replica
    dp_world: int  # how many replicas share each batch

    def forward(self, model: torch.nn.Module, pieces: list[Piece]) -> None:
        """Each piece's logits (of its ``ids``' last ``width`` + 1 positions) to its
        ``take`` (callers decide about gradients)."""
        ...

    def forward_backward(self, model: torch.nn.Module, pieces: list[Piece]) -> None:
        """Each piece forward, its ``take`` (a loss) and that loss backward: gradients
        add up over the pieces and, where they are averaged, meet once after the last."""
        ...

    def token_logp(
        self, logits: torch.Tensor, ids: torch.Tensor, width: int, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log p [B, width] of ``ids``' last ``width`` tokens under the sampling
        distribution (float32), from the logits ``forward`` gave; with the entropy per
        position (no gradient) if asked."""
        ...

    def clip_grads(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        """The gradients' total norm over the whole model before clipping, after
        clipping them to ``max_grad_norm``."""
        ...

    def grads_averaged(self) -> bool:
        """Whether the replicas' gradients are averaged (rather than left alone)."""
        ...

    def dp_group(self) -> dist.ProcessGroup | None:
        """The replicas' group (None: the default group)."""
        ...

    def after_optim_step(self) -> None:
        """After each optimizer step (a distributed optimizer sends what it stepped)."""
        ...

    def training_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """What the update passes run (a DDP wrapper where one is up, else ``model``)."""
        ...


def sampling_token_logp(
    logits: torch.Tensor,
    ids: torch.Tensor,
    width: int,
    *,
    temperature: float,
    top_p: float,
    with_entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p [B, width] of ``ids``' last ``width`` tokens under the sampling distribution
    (after temperature and top-p; float32 from any logits dtype), from the logits of the
    ``width`` + 1 positions before them over the whole vocabulary; with its entropy per
    position (no gradient) if asked."""
    full = sampling_log_softmax(
        logits[:, :-1], temperature=temperature, top_p=top_p, keep=ids[:, -width:]
    )
    logp = full.gather(-1, ids[:, -width:].unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        return logp, entropy(full.detach())


def passes_agree(model: torch.nn.Module) -> bool:
    """Whether a train-mode pass computes what an eval-mode one does: no dropout
    anywhere (HF attention's is a config value, LoRA's and others' are modules)."""
    config = getattr(model, "config", None)
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "hidden_dropout", 0.0):
        return False
    return not any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


class PolicyUpdate:
    """The step's maths over a backend's :class:`ModelParallel`. ``reference``: the KL
    penalty's frozen model (None: none, or with ``adapter_reference`` the base under
    the adapter, switched off: no second copy)."""

    def __init__(
        self,
        cfg: TrainSection,
        parallel: ModelParallel,
        device: torch.device,
        *,
        total_steps: int,
        adapter_reference: bool = False,
    ) -> None:
        # the pipeline's steps: where a linear learning-rate schedule reaches 0
        if cfg.lr_schedule == "linear" and not total_steps:
            raise ValueError("lr_schedule linear needs the run's total_steps")
        self.cfg = cfg
        self.parallel = parallel
        self.device = device
        self.total_steps = total_steps
        self.adapter_reference = adapter_reference
        self.step_times: dict[str, float] = {}  # the last run's, by part
        # (MoE layers, top k) when the backend replays the engine's routing: the batch
        # then carries the routes each piece's forward takes
        self.route_shape: tuple[int, int] | None = None
        self.routes: torch.Tensor | None = None  # the step's, this rank's rows (host)
        # tests and backends may replace it (a pass that cannot be shared)
        self.passes_agree = passes_agree

    def piece_routes(self, rows: torch.Tensor, positions: int) -> torch.Tensor | None:
        """The step's routes of ``rows``' first ``positions`` (None: none recorded)."""
        if self.routes is None:
            return None
        return self.routes[rows.cpu(), :positions]

    def has_reference(self, reference: torch.nn.Module | None) -> bool:
        return reference is not None or (self.adapter_reference and self.cfg.loss.kl_coef > 0)

    def lr(self, step: int, minibatch: int) -> float:
        """The learning rate of update ``minibatch`` of training step ``step``."""
        updates = self.cfg.minibatches
        return self.cfg.lr * lr_factor(
            step * updates + minibatch,
            self.total_steps * updates,
            self.cfg.lr_schedule,
            self.cfg.warmup_steps * updates,
        )

    def run(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        reference: torch.nn.Module | None,
        groups: list[Group],
        step: int,
    ) -> dict[str, float]:
        """Training step ``step`` (counted from 0): ``cfg.minibatches`` optimizer updates
        of ``model`` on this replica's share of ``groups``; its figures. Where its time
        went (packing, the pi_old pass, the updates) is in ``step_times``."""
        clock = [time.perf_counter()]

        def lap() -> float:
            clock.append(time.perf_counter())
            return round(clock[-1] - clock[-2], 4)

        share = pack_batch(groups, self.parallel.dp_rank, self.parallel.dp_world, self.route_shape)
        # routes stay in host memory (layers x k bytes a token): each piece takes its own
        self.routes = share.pop("routes", None)
        t = {k: v.to(self.device) for k, v in share.items()}
        n = t["ids"].shape[0]
        parts = minibatch_rows(n, self.cfg.minibatches, self.device)
        time_pack = lap()
        # Before the first update the weights are pi_old: that minibatch's old log-probs
        # are its own update pass's (detached), unless dropout makes the two passes differ
        first_is_old = self.passes_agree(model)
        old, ref, entropy_sum = self._before_update(
            model, reference, t, parts, parts[1:] if first_is_old else parts
        )
        stats: dict[str, float] = {
            "loss": 0.0,
            "clip_frac": 0.0,
            "is_weight_mean": 0.0,
            "entropy": 0.0,  # of the sampling distribution, over response tokens
            "grad_norm": 0.0,  # before clipping, mean over the updates made
            "skipped_updates": 0.0,
            "kl": 0.0,
            # the trainer's pi_old against the sampler's log-probs, on the sampled tokens
            "mismatch_mean": 0.0,
            "mismatch_max": 0.0,
            "is_truncated_frac": 0.0,  # tokens whose weight is_cap truncated
            "ratio_masked_frac": 0.0,  # tokens loss.mask_ratio left out
            "lr": self.lr(step, 0),  # the step's first update's
        }
        self.step_times = {"time_pack_s": time_pack, "time_old_logp_s": lap()}
        for j, idx in enumerate(parts):
            update = _Update(self, model, optim, t, idx, old, ref, len(parts), stats)
            entropy_sum += update.run(step, j, first_is_old and j == 0)
        stats["entropy"] = entropy_sum / float(t["mask"].sum().clamp(min=1.0))
        # the next step starts from zero_grad: kept, the grads would hold a model's size of
        # device memory and be offloaded and reloaded every cycle for nothing
        model.zero_grad(set_to_none=True)
        self.step_times["time_update_s"] = lap()
        return stats

    def _before_update(
        self,
        model: torch.nn.Module,
        reference: torch.nn.Module | None,
        t: dict[str, torch.Tensor],
        parts: list[torch.Tensor],
        old_parts: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """pi_old (these weights, before the update) on ``old_parts``, the reference's
        log-probs (with a KL penalty) on every part and the summed entropy of the
        sampling distribution over ``old_parts``' response tokens; a minibatch at a time,
        so the [rows, T, vocab] distributions never exist for the whole batch at once.
        In eval mode: an adapter's dropout (train mode only) would make them noisy
        draws instead of the distributions the ratios divide by."""
        model.eval()
        old = torch.zeros_like(t["mask"])
        ref = torch.zeros_like(t["mask"]) if self.has_reference(reference) else None
        entropy_sum = torch.zeros((), dtype=torch.float64)
        width = t["mask"].shape[1]

        def piece(out: torch.Tensor, idx: torch.Tensor, entropy_too: bool) -> Piece:
            """The rows ``idx``: their log-probs into ``out`` (and their entropy summed)."""
            ids = t["ids"][idx]

            def take(logits: torch.Tensor) -> torch.Tensor:
                out[idx], ent = self.parallel.token_logp(logits, ids, width, entropy_too)
                if ent is not None:
                    entropy_sum.add_((ent * t["mask"][idx]).sum().cpu())
                return logits.new_zeros(())

            return Piece(ids, width, take, self.piece_routes(idx, ids.shape[1]))

        with torch.no_grad():
            if ref is not None:
                if reference is None:  # an adapter's reference: the base, adapter off
                    with lora_utils.base_only(model):
                        self.parallel.forward(model, [piece(ref, i, False) for i in parts])
                else:
                    self.parallel.forward(reference, [piece(ref, i, False) for i in parts])
            self.parallel.forward(model, [piece(old, i, True) for i in old_parts])
        model.train()
        return old, ref, float(entropy_sum)


class _Update:
    """One optimizer update of a step: the rows ``idx``, their gradients accumulated
    over micro-batches, its figures added to ``stats``."""

    def __init__(
        self,
        owner: PolicyUpdate,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        t: dict[str, torch.Tensor],
        idx: torch.Tensor,
        old: torch.Tensor,
        ref: torch.Tensor | None,
        minibatches: int,
        stats: dict[str, float],
    ) -> None:
        self.owner, self.model, self.optim = owner, model, optim
        self.t, self.idx, self.old, self.ref = t, idx, old, ref
        self.minibatches, self.stats = minibatches, stats
        # this rank's response tokens in the step (every minibatch's rows together)
        self.step_tokens = float(t["mask"].sum().clamp(min=1.0))

    def run(self, step: int, minibatch: int, is_old: bool) -> float:
        """Update ``minibatch`` of step ``step``. ``is_old``: the weights are still
        pi_old, so the update pass's log-probs are the old ones too (and its entropy,
        returned summed over response tokens, is pi_old's)."""
        parallel, t, idx = self.owner.parallel, self.t, self.idx
        cfg = self.owner.cfg
        averaged = parallel.grads_averaged()
        # the minibatch's response tokens over every replica: each token weighs the same
        # whichever replica holds it (averaged gradients: hence the replicas factor)
        tokens = t["mask"][idx].sum()
        if dist.is_initialized() and parallel.dp_world > 1:
            dist.all_reduce(tokens, group=parallel.dp_group())
        self.tokens = tokens / parallel.dp_world if averaged else tokens
        lengths = t["lengths"].tolist()
        micro = micro_batches(
            idx.tolist(), lengths, cfg.micro_batch_size, cfg.max_tokens_per_micro_batch
        )
        first = t["ids"].shape[1] - 1 - t["mask"].shape[1]  # before the first predicted position
        self.model.zero_grad(set_to_none=True)
        self.entropy_sum = torch.zeros((), dtype=torch.float64)
        pieces = []
        for rows in micro:
            mi = torch.tensor(rows, device=self.owner.device)
            # up to this piece's own longest row: the padding after it costs nothing
            w = max(max(lengths[r] for r in rows) - 1 - first, 1)
            ids = t["ids"][mi, : first + 1 + w]
            routes = self.owner.piece_routes(mi, ids.shape[1])
            pieces.append(Piece(ids, w, self._loss_of(mi, ids, w, is_old), routes))
        parallel.forward_backward(parallel.training_model(self.model), pieces)
        norm = parallel.clip_grads(list(lora_utils.trainable(self.model)))
        # A non-finite gradient would write NaN into every weight and every later
        # rollout: skip that update and count it. The gradients met over the replicas
        # before this, so every rank sees the same norm and skips alike.
        if torch.isfinite(norm):
            for group in self.optim.param_groups:
                group["lr"] = self.owner.lr(step, minibatch)
            self.optim.step()
            parallel.after_optim_step()
            self.stats["grad_norm"] += float(norm) / self.minibatches
        else:
            self.stats["skipped_updates"] += 1
        return float(self.entropy_sum)

    def _loss_of(self, mi: torch.Tensor, ids: torch.Tensor, w: int, is_old: bool) -> Take:
        t, old, ref, stats = self.t, self.old, self.ref, self.stats
        minibatches = self.minibatches

        def take(logits: torch.Tensor) -> torch.Tensor:
            logp, ent = self.owner.parallel.token_logp(logits, ids, w, is_old)
            if ent is not None:  # pi_old's log-probs and entropy are this pass's
                old[mi, :w] = logp.detach()
                self.entropy_sum.add_((ent * t["mask"][mi, :w]).sum().cpu())
            loss, s = policy_loss(
                logp,
                old[mi, :w],
                t["adv"][mi],
                t["mask"][mi, :w],
                self.owner.cfg.loss,
                behavior_logp=t["behavior"][mi, :w],
                ref_logp=ref[mi, :w] if ref is not None else None,
                tokens=self.tokens,
            )
            share = len(mi) / len(self.idx) / minibatches
            stats["loss"] += loss.item() / minibatches
            stats["clip_frac"] += s["clip_frac"] * share
            stats["is_weight_mean"] += s["is_weight_mean"] * share
            stats["kl"] += s["kl"] * share
            # token means over the step: each micro-batch weighs by its response tokens
            # (a row share would let three short rows outweigh one long one)
            tokens = float(t["mask"][mi, :w].sum()) / self.step_tokens
            for key in ("mismatch_mean", "is_truncated_frac", "ratio_masked_frac"):
                stats[key] += s[key] * tokens
            stats["mismatch_max"] = max(stats["mismatch_max"], s["mismatch_max"])
            return loss

        return take
