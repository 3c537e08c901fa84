"""Named tensors from one trainer rank to another over the default process group: how
each pipeline stage's part of the weights (and, at checkpoint steps, of the optimizer
state) reaches rank 0, which builds the weight cache and writes checkpoints.

A header first (its length, then UTF-8 JSON of each tensor's name, dtype and shape:
plain values, never pickle), then the tensors in its order. Under NCCL the tensors
travel on the device and land in host memory; under gloo they stay on the host.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch
import torch.distributed as dist

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
