"""A trainer's state by stable names, and the page-locked host memory it lives in
while offloaded."""

from __future__ import annotations

import mmap
import weakref

import torch

# A tensor of the training state, named stably across offload cycles: ("param", name),
# ("grad", name), ("buffer", module, name), ("optim", param name, key), and the KL
# reference's ("refparam", name), ("refbuffer", module, name)
StateKey = tuple[str, ...]


def _buffers(model: torch.nn.Module, kind: str) -> dict[StateKey, torch.Tensor]:
    return {
        (kind, mod_name, name): b
        for mod_name, mod in model.named_modules()
        for name, b in mod._buffers.items()
        if b is not None
    }


def state_tensors(
    model: torch.nn.Module, optim: torch.optim.Optimizer, reference: torch.nn.Module | None
) -> dict[StateKey, torch.Tensor]:
    """Every tensor of the training state: parameters, grads, buffers, optimizer state,
    and the KL reference's (offloaded and reloaded with the policy)."""
    params = dict(model.named_parameters())
    out: dict[StateKey, torch.Tensor] = {("param", n): p.data for n, p in params.items()}
    out.update({("grad", n): p.grad for n, p in params.items() if p.grad is not None})
    out.update(_buffers(model, "buffer"))
    if reference is not None:
        out.update({("refparam", n): p.data for n, p in reference.named_parameters()})
        out.update(_buffers(reference, "refbuffer"))
    name_of = {p: n for n, p in params.items()}
    for p, state in optim.state.items():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                out[("optim", name_of[p], k)] = v
    return out


def install_state(
    model: torch.nn.Module,
    optim: torch.optim.Optimizer,
    reference: torch.nn.Module | None,
    tensors: dict[StateKey, torch.Tensor],
) -> None:
    """Put each tensor in its place (parameters first: a grad must match its
    parameter's device)."""
    params = dict(model.named_parameters())
    for key, t in sorted(tensors.items(), key=lambda kv: kv[0][0] != "param"):
        kind = key[0]
        if kind == "param":
            params[key[1]].data = t
        elif kind == "grad":
            params[key[1]].grad = t
        elif kind == "buffer":
            model.get_submodule(key[1])._buffers[key[2]] = t
        elif kind in ("refparam", "refbuffer"):
            if reference is None:
                raise ValueError(f"{'.'.join(key)}: the trainer has no reference model")
            if kind == "refparam":
                reference.get_parameter(key[1]).data = t
            else:
                reference.get_submodule(key[1])._buffers[key[2]] = t
        else:
            optim.state[params[key[1]]][key[2]] = t


def _unpin(pinned: list[torch.Tensor]) -> None:
    # the memory stays valid (pageable) after this; each mapping goes with its last view
    for raw in pinned:
        torch.cuda.cudart().cudaHostUnregister(raw.data_ptr())


class PinnedHostBuffers:
    """Page-locked host homes for the device tensors of the training state.

    Copies between the device and page-locked memory run at the link's speed and
    can all be queued before one wait; pageable memory goes through a bounce
    buffer, several times slower. Each tensor gets an anonymous mapping of its own,
    registered with CUDA at its exact size: torch's pinned allocator rounds every
    block up to a power of two (a 1.1 GB embedding would lock 2 GB), registering
    malloc'd memory fails on pages shared with another registered block, and a
    storage per tensor keeps ``torch.save`` of an offloaded trainer as it is on the
    device (one storage per tensor, each its own dtype).
    """

    def __init__(self, specs: list[tuple[StateKey, torch.dtype, torch.Size]]) -> None:
        self.specs = specs
        self.views: dict[StateKey, torch.Tensor] = {}
        pinned: list[torch.Tensor] = []
        # holds the list until it runs: pages are unregistered before they can be unmapped
        weakref.finalize(self, _unpin, pinned).atexit = False
        for key, dtype, shape in specs:
            nbytes = shape.numel() * dtype.itemsize
            if nbytes == 0:  # nothing to copy (and a mapping cannot be empty)
                self.views[key] = torch.empty(shape, dtype=dtype)
                continue
            raw = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
            status = int(torch.cuda.cudart().cudaHostRegister(raw.data_ptr(), nbytes, 0))
            if status != 0:
                raise RuntimeError(
                    f"cannot page-lock {nbytes} bytes of host memory for the trainer's "
                    f"offload of {'.'.join(key)} (cudaError {status})"
                )
            pinned.append(raw)
            self.views[key] = raw.view(dtype).view(shape)
