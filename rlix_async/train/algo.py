"""GRPO maths: group-relative advantages, DAPO and CISPO token losses, IS correction, KL.

Pure functions on tensors, tested without processes. Shapes: ``B`` sequences,
``T`` response positions; ``mask`` is 1 on real response tokens.
"""

from __future__ import annotations

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


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position; logits [B, T, V], targets [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


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
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level mean loss over every response token of the batch (DAPO style).

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
    n = mask.sum().clamp(min=1.0)
    adv = advantages.unsqueeze(-1)
    ratio = torch.exp(logp - old_logp)
    w = is_weights(old_logp, behavior_logp, mask, cfg.is_cap) if behavior_logp is not None else mask
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
        "clip_frac": float((clip_frac * mask).sum() / n),
        "is_weight_mean": float(w.sum() / n),
        "kl": float(kl),
    }
    return loss, stats
