"""The whole model gathered onto rank 0 of a model-parallel trainer, which builds the
weight cache from it (:func:`gather_model`): each stage's tensor-parallel parts onto its
first rank (an all-gather), then each stage's part to rank 0 as named tensors over the
default process group (:func:`send_tensors`, :func:`recv_tensors`); under expert
parallel the replicas holding the other experts send those too.

A header first (its length, then UTF-8 JSON of each tensor's name, dtype and shape:
plain values, never pickle), then the tensors in its order. Under NCCL the tensors
travel on the device and land in host memory; under gloo they stay on the host.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from rlix_async.train.megatron_moe import expert_global_name, is_expert
from rlix_async.train.pipeline_parallel import from_stage
from rlix_async.train.tensor_parallel import merge_tensor, split_dim

# what a header may name: the dtypes a trainer's weights and optimizer state have
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64)
}


def _wire_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def send_tensors(tensors: Mapping[str, torch.Tensor], dst: int, device: torch.device) -> None:
    """``tensors`` to rank ``dst`` (which calls :func:`recv_tensors`); ``device``: this
    rank's device (the tensors cross on it under NCCL)."""
    wire = _wire_device(device)
    header = json.dumps(
        [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
    ).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=wire), dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(wire), dst)
    for t in tensors.values():
        dist.send(t.detach().to(wire).contiguous(), dst)
    if wire.type == "cuda":  # NCCL's send is queued: done before the group may go
        torch.cuda.synchronize(wire)


def recv_tensors(src: int, device: torch.device) -> dict[str, torch.Tensor]:
    """What rank ``src`` sends with :func:`send_tensors`, in host memory."""
    wire = _wire_device(device)
    size = torch.empty(1, dtype=torch.int64, device=wire)
    dist.recv(size, src)
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
    dist.recv(raw, src)
    out: dict[str, torch.Tensor] = {}
    for name, dtype, shape in json.loads(raw.cpu().numpy().tobytes()):
        if dtype not in _DTYPES:
            raise ValueError(f"rank {src} sent {name} as {dtype}: not a trainer state dtype")
        t = torch.empty(shape, dtype=_DTYPES[dtype], device=wire)
        dist.recv(t, src)
        out[name] = t.cpu()
    return out


def _gather(
    name: str, local: torch.Tensor, tp_rank: int, tp: int, vocab: int
) -> torch.Tensor | None:
    """The full tensor ``name`` on the stage's first rank (None elsewhere) from the
    parts of its tensor-parallel group."""
    from megatron.core import parallel_state

    if split_dim(name) is None:
        return local.detach().to("cpu", copy=True) if tp_rank == 0 else None
    group = parallel_state.get_tensor_model_parallel_group()
    local = local.detach().contiguous()
    if dist.get_backend(group) == "gloo":  # the constructor's group: host tensors
        local = local.cpu()
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local, group=group)
    if tp_rank != 0:
        return None
    # the merge is a new tensor: to the host once (no second copy when already there)
    return merge_tensor(name, parts, vocab).to("cpu")


def gather_model(
    state: Mapping[str, Any],
    *,
    tp: tuple[int, int],
    stage: tuple[int, int],
    replica: tuple[int, int],
    shape: tuple[int, bool, int],
    device: torch.device,
    rank_of: Callable[[int, int, int], int],
    experts_per_rank: int = 0,
) -> dict[str, torch.Tensor] | None:
    """The whole (tp=1/pp=1) model on rank 0, None elsewhere, from every rank's
    ``state`` (its model's state dict). ``tp``, ``stage``: (this rank's, how many);
    ``replica``: (this rank's data-parallel rank, expert parallel); ``shape``: the
    model's layers, whether its embeddings are tied, its vocabulary; ``rank_of(stage,
    replica, tp_rank)``: where a part lives. Every rank of the first replica takes
    part; under expert parallel the next ``ep - 1`` replicas send their experts
    (``experts_per_rank`` each, renamed to their global index); the others hold the
    same weights as one of these."""
    (tp_rank, tp_size), (stage_rank, pp), (dp_rank, ep) = tp, stage, replica
    if dp_rank >= ep:
        return None
    layers, tied, vocab = shape
    local = {}
    for name, v in state.items():
        # the first replica's everything, the next ones' experts (ep > 1: tp 1)
        if isinstance(v, torch.Tensor) and (dp_rank == 0 or is_expert(name)):
            full = _gather(name, v, tp_rank, tp_size, vocab)
            if full is not None:
                local[name] = full
    if tp_rank != 0:
        return None
    staged = from_stage(local, stage_rank, pp, layers, tied)
    mine = {expert_global_name(k, dp_rank, experts_per_rank): v for k, v in staged.items()}
    if (stage_rank, dp_rank) != (0, 0):
        send_tensors(mine, 0, device)  # type: ignore[arg-type]
        return None
    out: dict[str, torch.Tensor] = dict(mine)  # type: ignore[arg-type]
    for s in range(pp):
        for d in range(ep):
            if (s, d) != (0, 0):
                out.update(recv_tensors(rank_of(s, d, 0), device))
    return out
