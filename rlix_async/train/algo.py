"""GRPO maths: group-relative advantages, DAPO and CISPO token losses, IS correction, KL,
and the learning-rate schedule.

Pure functions on tensors, tested without processes. Shapes: ``B`` sequences,
``T`` response positions; ``mask`` is 1 on real response tokens.
"""

from __future__ import annotations

import math

import torch

from rlix_async.config import LossConfig


def group_advantages(
    rewards: torch.Tensor, *, scale: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Advantages within one group of responses to the same prompt.

    ``r - mean(r)``, divided by the group's std when ``scale`` (GRPO); a group
    whose rewards are all equal carries no signal and gets zeros.
    """
    centred = rewards - rewards.mean()
    if not scale or rewards.numel() < 2:
        return centred
    return centred / (rewards.std(unbiased=False) + eps)


def token_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0, top_p: float = 1.0
) -> torch.Tensor:
    """log p(target) per position under the distribution tokens were sampled from.

    logits [B, T, V], targets [B, T]. The logits are divided by ``temperature`` and,
    when ``top_p < 1``, tokens outside the nucleus are masked out before the softmax,
    exactly as vLLM's sampler does (``apply_top_k_top_p``: sort ascending, drop the
    tokens whose cumulative probability is at most ``1 - top_p``, always keep the most
    likely), so these match the engine's ``processed_logprobs`` and the importance
    ratio compares like with like. The mask carries no gradient; the kept logits do.
    """
    logp = sampling_log_softmax(logits, temperature=temperature, top_p=top_p, keep=targets)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def sampling_log_softmax(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    top_p: float = 1.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities of every token under the sampling distribution (float32).

    ``keep`` [B, T]: token ids never cut by top-p, the tokens actually sampled. The
    engine sampled them from its nucleus, but the trainer's logits differ from the
    engine's in the last bits (and after an update, by more): a token at the edge of
    the nucleus would get log-prob -inf here and turn the loss into NaN. Kept, it
    is renormalised over the nucleus plus itself: the engine's value whenever it is
    inside, finite always.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    scaled = logits.float() / temperature
    if top_p < 1.0:
        outside = outside_top_p(scaled.detach(), top_p)
        if keep is not None:
            outside = outside.scatter(-1, keep.unsqueeze(-1), False)
        scaled = scaled.masked_fill(outside, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def entropy(logp: torch.Tensor) -> torch.Tensor:
    """Entropy per position of the distributions ``logp`` [..., V] (masked tokens add 0)."""
    p = logp.exp()
    return -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


def outside_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """True for the tokens vLLM's top-p leaves out (same rule, same tie order)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1 - top_p
    drop[..., -1] = False  # the most likely token always stays
    return torch.zeros_like(drop).scatter(-1, order, drop)


def is_weights(
    old_logp: torch.Tensor, behavior_logp: torch.Tensor, mask: torch.Tensor, cap: float = 2.0
) -> torch.Tensor:
    """Truncated importance weights for tokens sampled by older (or other-engine) weights.

    ``min(pi_old / pi_behavior, cap)`` per token, detached: corrects for the
    rollout engine's weights lagging the trainer's (async, bounded staleness).
    """
    w = torch.exp((old_logp - behavior_logp).clamp(max=20.0)).clamp(max=cap)
    return (w * mask).detach()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
    *,
    behavior_logp: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    tokens: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level mean loss over every response token of the batch (DAPO style).

    With ``tokens`` the per-token sum is divided by that count instead: the trainer
    passes the minibatch's tokens over all ranks (times the ranks, since DDP averages
    gradients), so the update is the mean over the global batch's tokens whatever the
    split between ranks and micro-batches.

    ``advantages`` is per sequence [B]; ``old_logp`` the trainer's log-probs
    before this update, ``behavior_logp`` the engine's at sampling time. Computed
    in float32 whatever the inputs' dtype: in bf16 (8 mantissa bits) a ratio
    of 1.004 reads as 1.0, below the clip range's resolution.
    """
    logp, old_logp, advantages = logp.float(), old_logp.float(), advantages.float()
    if behavior_logp is not None:
        behavior_logp = behavior_logp.float()
    if ref_logp is not None:
        ref_logp = ref_logp.float()
    mask = mask.float()
    # positions outside the responses (prompt, padding) may hold -inf log-probs:
    # zeroed, so that 0 * inf never turns the masked sum into NaN
    live = mask > 0
    logp, old_logp = logp.where(live, 0.0), old_logp.where(live, 0.0)
    if behavior_logp is not None:
        behavior_logp = behavior_logp.where(live, 0.0)
    if ref_logp is not None:
        ref_logp = ref_logp.where(live, 0.0)
    # the sums are divided by ``tokens`` when given (the minibatch's response tokens
    # over every rank and micro-batch: each token weighs the same whoever holds it),
    # else by this call's own count; the statistics are always this call's means
    own = mask.sum().clamp(min=1.0)
    n = own if tokens is None else torch.as_tensor(tokens, dtype=torch.float32).clamp(min=1.0)
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    w, mismatch = mask, dict[str, float]()
    if behavior_logp is not None:
        w, mismatch = _behaviour_weights(old_logp, behavior_logp, mask, own, cfg)
    if cfg.kind == "dapo":
        clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        clip_frac = ((ratio - clipped).abs() > 1e-6).float()
    else:  # cispo: clip the (detached) IS weight, keep every token's gradient
        clipped = ratio.clamp(1 - cfg.eps_low, 1 + cfg.eps_high).detach()
        per_token = -clipped * adv * logp
        clip_frac = ((ratio - clipped).abs() > 1e-6).float()
    loss = (per_token * w).sum() / n
    kl = logp.new_zeros(())  # on logp's device: the stats read it with the rest
    if ref_logp is not None and cfg.kl_coef > 0:
        # k3 estimator: unbiased, non-negative
        d = ref_logp - logp
        kl = ((torch.exp(d) - d - 1) * mask).sum() / n
        loss = loss + cfg.kl_coef * kl
    stats = {
        "clip_frac": float((clip_frac * mask).sum() / own),
        "is_weight_mean": float(w.sum() / own),
        "kl": float(kl.detach() * n / own),
        **mismatch,
    }
    return loss, stats


def _behaviour_weights(
    old_logp: torch.Tensor,
    behavior_logp: torch.Tensor,
    mask: torch.Tensor,
    own: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The tokens' weights against the sampler (truncated IS, and the IcePop mask when
    ``cfg.mask_ratio`` is set), and how far the trainer's pi_old is from the sampler's
    log-probs on the sampled tokens: mean and max |log pi_old - log pi_behaviour|, the
    fraction of tokens whose weight the cap truncated, and the fraction masked."""
    live = mask > 0
    diff = (old_logp - behavior_logp).detach()
    w = is_weights(old_logp, behavior_logp, mask, cfg.is_cap)
    gap = diff.abs().where(live, 0.0)
    stats = {
        "mismatch_mean": float(gap.sum() / own),
        "mismatch_max": float(gap.max()) if gap.numel() else 0.0,
        "is_truncated_frac": float(((diff > math.log(cfg.is_cap)) & live).sum() / own),
        "ratio_masked_frac": 0.0,
    }
    if cfg.mask_ratio is not None:
        bound = math.log(cfg.mask_ratio)
        outside = (diff.abs() > bound) & live
        w = w.where(~outside, 0.0)
        stats["ratio_masked_frac"] = float(outside.sum() / own)
    return w, stats


def lr_factor(update: int, total: int, schedule: str, warmup: float = 0) -> float:
    """The learning rate's multiplier at optimizer update ``update`` (0-based) of
    ``total``: transformers' ``get_linear_schedule_with_warmup`` (``linear``) and
    ``get_constant_schedule_with_warmup`` (``constant``), the same numbers, so a
    run compares with a TRL run update for update. ``warmup`` in updates."""
    if update < warmup:
        return update / max(1.0, warmup)
    if schedule == "constant":
        return 1.0
    if schedule == "linear":
        return max(0.0, (total - update) / max(1.0, total - warmup))
    raise ValueError(f"unknown lr schedule {schedule!r} (constant or linear)")
