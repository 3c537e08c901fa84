"""The whole model gathered onto rank 0 of a model-parallel trainer, which builds the
weight cache from it (:func:`gather_model`): each stage's tensor-parallel parts onto its
first rank (an all-gather per bucket), then each stage's part to rank 0 as named
tensors over the default process group (:func:`send_tensors`, :func:`recv_tensors`);
under expert parallel the replicas holding the other experts send those too.

A header first (its length, then UTF-8 JSON of each tensor's name, dtype and shape:
plain values, never pickle), then the tensors in its order, packed into buckets of one
dtype (:func:`buckets`: at most ``BUCKET_BYTES`` under NCCL, as the weight cache's;
``HOST_BUCKET_BYTES`` over gloo, measured) so a model of
a thousand tensors costs a few collectives, not a thousand. Under NCCL the tensors
travel on the device and land in host memory, each bucket's copy to page-locked host
memory overlapping the next bucket's transfer; under gloo they stay on the host.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
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


BUCKET_BYTES = 64 << 20  # as the weight cache's default bucket (weights.bucket_mb)
# over gloo (host memory) smaller buckets gather faster: SmolLM2 at tp 3 took 1.07 s
# in 8 MiB buckets, 1.36 s in 1 MiB and 1.65 s in 64 MiB ones (copies that stay in
# cache; docs/PERF.md)
HOST_BUCKET_BYTES = 8 << 20


def _bucket_bytes(group: dist.ProcessGroup | None = None) -> int:
    return BUCKET_BYTES if dist.get_backend(group) == "nccl" else HOST_BUCKET_BYTES


def _wire_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def buckets(sizes: Sequence[tuple[torch.dtype, int]], limit: int = BUCKET_BYTES) -> list[range]:
    """Consecutive runs of tensors (``sizes``: each one's dtype and elements) of one
    dtype and at most ``limit`` bytes together (a larger tensor alone): the indices of
    each run. Both ends of a transfer compute it from the same header."""
    out: list[range] = []
    start, used = 0, 0
    for i, (dtype, n) in enumerate(sizes):
        nbytes = n * dtype.itemsize
        if i > start and (dtype != sizes[start][0] or used + nbytes > limit):
            out.append(range(start, i))
            start, used = i, 0
        used += nbytes
    if sizes:
        out.append(range(start, len(sizes)))
    return out


class _HostCopies:
    """Device-to-host copies that overlap the next bucket's transfer: each lands in one
    of two page-locked staging buffers without waiting, and moves on into ordinary
    host memory (what is kept: page-locked memory is scarce and the allocator keeps
    it) when its buffer is needed again or at ``wait``. A host tensor is kept as it
    is, or copied (``copy``: a view of a parameter the next step changes). What
    ``take`` returns holds its values only after ``wait``."""

    def __init__(self) -> None:
        self._staging: list[torch.Tensor | None] = [None, None]
        self._pending: list[tuple[Any, torch.Tensor, torch.Tensor] | None] = [None, None]
        self._turn = 0

    def take(self, t: torch.Tensor, copy: bool = False) -> torch.Tensor:
        if t.device.type != "cuda":
            return t.clone() if copy else t.contiguous()
        slot, self._turn = self._turn, 1 - self._turn
        self._drain(slot)
        nbytes = t.numel() * t.element_size()
        buf = self._staging[slot]
        if buf is None or buf.numel() < nbytes:
            buf = self._staging[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = buf[:nbytes].view(t.dtype).view(t.shape)
        staged.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        out = torch.empty(t.shape, dtype=t.dtype)
        self._pending[slot] = (done, staged, out)
        return out

    def _drain(self, slot: int) -> None:
        pending = self._pending[slot]
        if pending is not None:
            done, staged, out = pending
            done.synchronize()
            out.copy_(staged)
            self._pending[slot] = None

    def wait(self) -> None:
        for slot in (self._turn, 1 - self._turn):  # the older copy first
            self._drain(slot)


def send_tensors(tensors: Mapping[str, torch.Tensor], dst: int, device: torch.device) -> None:
    """``tensors`` to rank ``dst`` (which calls :func:`recv_tensors`), one send per
    bucket; ``device``: this rank's device (the tensors cross on it under NCCL)."""
    wire = _wire_device(device)
    items = list(tensors.items())
    header = json.dumps(
        [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in items]
    ).encode()
    dist.send(torch.tensor([len(header)], dtype=torch.int64, device=wire), dst)
    dist.send(torch.frombuffer(bytearray(header), dtype=torch.uint8).to(wire), dst)
    for run in buckets([(t.dtype, t.numel()) for _, t in items], _bucket_bytes()):
        flat = torch.cat([items[i][1].detach().reshape(-1).to(wire) for i in run])
        dist.send(flat, dst)
    if wire.type == "cuda":  # NCCL's send is queued: done before the group may go
        torch.cuda.synchronize(wire)


def recv_tensors(src: int, device: torch.device) -> dict[str, torch.Tensor]:
    """What rank ``src`` sends with :func:`send_tensors`, in host memory (each bucket's
    copy to the host overlapping the next one's transfer)."""
    wire = _wire_device(device)
    size = torch.empty(1, dtype=torch.int64, device=wire)
    dist.recv(size, src)
    raw = torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
    dist.recv(raw, src)
    header = json.loads(raw.cpu().numpy().tobytes())
    for name, dtype, _ in header:
        if dtype not in _DTYPES:
            raise ValueError(f"rank {src} sent {name} as {dtype}: not a trainer state dtype")
    sizes = [(_DTYPES[dtype], math.prod(shape)) for _, dtype, shape in header]
    copies, landed = _HostCopies(), []
    for run in buckets(sizes, _bucket_bytes()):
        flat = torch.empty(sum(sizes[i][1] for i in run), dtype=sizes[run[0]][0], device=wire)
        dist.recv(flat, src)
        landed.append((run, copies.take(flat)))
    copies.wait()
    out: dict[str, torch.Tensor] = {}
    for run, host in landed:
        offset = 0
        for i in run:
            name, _, shape = header[i]
            out[name] = host[offset : offset + sizes[i][1]].view(shape)
            offset += sizes[i][1]
    return out


def _gather_parts(
    state: Mapping[str, torch.Tensor], tp_rank: int, tp: int, vocab: int
) -> dict[str, torch.Tensor] | None:
    """The full tensors of ``state`` on the stage's first rank (None elsewhere) from the
    parts of its tensor-parallel group: one all-gather per bucket of split tensors."""
    from megatron.core import parallel_state

    out: dict[str, torch.Tensor] = {}
    copies = _HostCopies()
    split = [(n, t.detach()) for n, t in state.items() if split_dim(n) is not None]
    for name, t in state.items():
        if split_dim(name) is None and tp_rank == 0:
            out[name] = copies.take(t.detach(), copy=True)
    if split and tp > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        # the constructor's group is gloo: host tensors
        host = dist.get_backend(group) == "gloo"
        for run in buckets([(t.dtype, t.numel()) for _, t in split], _bucket_bytes(group)):
            flat = torch.cat([split[i][1].reshape(-1) for i in run])
            flat = flat.cpu() if host else flat
            parts = [torch.empty_like(flat) for _ in range(tp)]
            dist.all_gather(parts, flat, group=group)
            if tp_rank != 0:
                continue
            offset = 0
            for i in run:
                name, t = split[i]
                pieces = [p[offset : offset + t.numel()].view(t.shape) for p in parts]
                # the merge is a new tensor: to the host once
                out[name] = copies.take(merge_tensor(name, pieces, vocab))
                offset += t.numel()
    elif tp_rank == 0:
        for name, t in split:
            full = merge_tensor(name, [t], vocab)
            out[name] = copies.take(full, copy=True)
    copies.wait()
    return out if tp_rank == 0 else None


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
    # the first replica's everything, the next ones' experts (ep > 1: tp 1)
    mine_only = {
        name: v
        for name, v in state.items()
        if isinstance(v, torch.Tensor) and (dp_rank == 0 or is_expert(name))
    }
    local = _gather_parts(mine_only, tp_rank, tp_size, vocab)
    if local is None:
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
