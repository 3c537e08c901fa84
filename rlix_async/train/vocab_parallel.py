"""The sampling distribution's log-probs and entropy from logits split by vocabulary
over the tensor-parallel ranks (Megatron's ``parallel_output``), never gathered.

At tensor parallel T each rank's output layer computes the logits of its V/T rows
of the (padded) vocabulary. Gathering them gives every rank a [rows, positions, V]
float32 tensor: for a 152k vocabulary and 16k tokens, 9.7 GB per rank, T times what
its own slice needs. Here each rank keeps its slice: the log-probs of the sampled
tokens come from Megatron's ``vocab_parallel_cross_entropy`` (its max and
normaliser all-reduced over the group, its backward local: softmax minus one-hot on
each rank's slice, because the loss is computed alike on every rank of the group),
and the entropy from the same two all-reduces plus one of sum(p x logit). Rows of the
padded vocabulary past the true one are never a token: their logits are -inf, so the
figures equal the one-rank ones (tests compare them).

Top-p needs the whole vocabulary sorted: under ``rollout.top_p`` < 1 the trainer gathers
the logits instead (``MegatronTrainer._vocab_parallel``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def vocab_parallel_logp(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    vocab: int,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p [B, W] of ``targets`` [B, W] under softmax(logits / temperature) from this
    rank's vocabulary slice ``logits`` [B, W, V/T] (rows rank x V/T on of the padded
    vocabulary, of which the first ``vocab`` are real); and the entropy [B, W] if asked."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    per = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * per
    scaled = logits.float() / temperature
    if start + per > vocab:  # the last rank's padding rows
        padding = torch.arange(start, start + per, device=scaled.device) >= vocab
        scaled = scaled.masked_fill(padding, float("-inf"))
    ent = None
    if with_entropy:
        with torch.no_grad():
            ent = _entropy(scaled.detach(), parallel_state.get_tensor_model_parallel_group())
    # Megatron's function subtracts the max in place (its input is ours to spend)
    return -vocab_parallel_cross_entropy(scaled, targets), ent


def _entropy(scaled: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """-sum p log p = logsumexp - sum p x over the whole vocabulary, from one slice."""
    peak = scaled.amax(-1, keepdim=True)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
    e = (scaled - peak).exp()
    total = e.sum(-1, keepdim=True)
    dist.all_reduce(total, group=group)
    p = e / total
    px = torch.where(p > 0, p * scaled, torch.zeros_like(p)).sum(-1)  # -inf x 0: 0
    dist.all_reduce(px, group=group)
    return (peak + total.log()).squeeze(-1) - px
