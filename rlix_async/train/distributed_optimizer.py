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


class ParameterOwners:
    """Which data-parallel replica steps each of ``params`` (the trainable parameters,
    in the optimizer's order), and the broadcast that follows each step.
    ``global_rank[d]``: replica d's rank (at this rank's model-parallel position) in
    the default group, which collectives name their source by."""

    def __init__(
        self, params: Sequence[torch.nn.Parameter], dp_rank: int, global_rank: Sequence[int]
    ) -> None:
        if len(params) < len(global_rank):
            raise ValueError(
                f"distributed_optimizer: {len(global_rank)} replicas share {len(params)} "
                "parameters, so one would hold none; use fewer replicas or turn it off"
            )
        self.params = list(params)
        self.owner = owners([p.numel() for p in params], len(global_rank))
        self.global_rank = list(global_rank)
        self.mine = [p for p, o in zip(self.params, self.owner, strict=True) if o == dp_rank]

    def broadcast(self, group: dist.ProcessGroup | None) -> None:
        """Every parameter from its owner to the other replicas, one flat broadcast per
        owner and dtype."""
        for d, src in enumerate(self.global_rank):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for p, o in zip(self.params, self.owner, strict=True):
                if o == d:
                    by_dtype.setdefault(p.dtype, []).append(p.data)
            for tensors in by_dtype.values():
                flat = _flatten_dense_tensors(tensors)
                dist.broadcast(flat, src=src, group=group)
                if dist.get_rank() != src:
                    unflat = _unflatten_dense_tensors(flat, tensors)
                    for t, v in zip(tensors, unflat, strict=True):
                        t.copy_(v)
