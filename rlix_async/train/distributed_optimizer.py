"""The distributed optimizer (``train.distributed_optimizer``): the optimizer state
sharded over the data-parallel group by whole parameters (ZeRO stage 1).

Every replica holds every parameter and, after the gradients are averaged, every
gradient; but each data-parallel rank keeps the optimizer state (the float32 main
copy and both Adam moments: 12 of a bf16 parameter's 16 bytes) of only the
parameters it owns, steps only those, and then sends them to the other replicas.
Owners are chosen by :func:`owners`, a pure function of the parameter sizes, so every
rank computes the same split without talking, and a checkpoint resumes at another
data-parallel size (each rank takes the state of what it owns then).

Megatron's own ``DistributedOptimizer`` splits a contiguous gradient buffer by
element ranges and needs Megatron's DDP, whose buckets hold the process groups they
were built with (the time-sharing cycle rebuilds the groups every step) and whose
reduce-scatter gloo lacks; whole parameters compose with this trainer's mixed
precision (``MainParamsAdamW``), offload and sharded checkpoints as they are. Traffic:
the gradients' all-reduce as before, plus one broadcast of each parameter from its
owner, which is what the all-gather half of Megatron's scheme costs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def owners(sizes: Sequence[int], ranks: int) -> list[int]:
    """The data-parallel rank owning each parameter (``sizes``: their element counts,
    in the optimizer's order): largest first, each to the least loaded rank (the lower
    one on ties), so the ranks hold about the same number of elements."""
    load = [0] * ranks
    out = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(ranks), key=lambda r: (load[r], r))
        out[i] = r
        load[r] += sizes[i]
    return out


def broadcast_owned(
    params: Sequence[torch.Tensor],
    owner_of: Sequence[int],
    global_rank: Sequence[int],
    group: dist.ProcessGroup | None,
) -> None:
    """Every parameter from its owner to the other data-parallel ranks, one flat
    broadcast per owner and dtype. ``global_rank[d]``: data-parallel rank d's rank in
    the default group (collectives name their source so)."""
    for d, src in enumerate(global_rank):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p, o in zip(params, owner_of, strict=True):
            if o == d:
                by_dtype.setdefault(p.dtype, []).append(p.data)
        for tensors in by_dtype.values():
            flat = _flatten_dense_tensors(tensors)
            dist.broadcast(flat, src=src, group=group)
            if dist.get_rank() != src:
                for t, v in zip(tensors, _unflatten_dense_tensors(flat, tensors), strict=True):
                    t.copy_(v)
