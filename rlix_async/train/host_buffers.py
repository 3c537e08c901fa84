"""A trainer's state by stable names, the page-locked host memory it lives in while
offloaded, and the moves between the two (:class:`DeviceOffload`)."""

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


class DeviceOffload:
    """A trainer's state (policy, optimizer, KL reference) moved off its device into
    page-locked host buffers and back.

    The buffers are allocated at the first offload and reused by every later one (new
    ones only when the set of tensors changes: an offload before the first step has no
    optimizer state yet); all copies are queued, then waited for once. Afterwards the
    device holds nothing of the trainer (the CUDA context aside).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.moved: list[StateKey] = []  # what offload() moved; reload() moves it back
        self._host: PinnedHostBuffers | None = None

    def offload(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        reference: torch.nn.Module | None,
    ) -> None:
        self.moved = self._move_to_host(model, optim, reference)
        torch._C._cuda_clearCublasWorkspaces()  # allocator blocks that empty_cache keeps
        torch.cuda.empty_cache()

    def _move_to_host(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        reference: torch.nn.Module | None,
    ) -> list[StateKey]:
        """Copy every device tensor of the state into its host buffer and put that in its place.

        A method of its own so that, once it returns, nothing references the device
        tensors any more (a loop variable in ``offload`` would keep the last one alive).
        """
        resident = {
            k: t
            for k, t in state_tensors(model, optim, reference).items()
            if t.device == self.device
        }
        specs = [(k, t.dtype, t.shape) for k, t in resident.items()]
        if self._host is None or self._host.specs != specs:
            self._host = None  # the old pages are unlocked before the new ones are locked
            self._host = PinnedHostBuffers(specs)
        host = self._host.views
        for k, t in resident.items():
            host[k].copy_(t, non_blocking=True)
        torch.cuda.synchronize(self.device)  # every copy has landed: the device copies may go
        install_state(model, optim, reference, {k: host[k] for k in resident})
        return list(resident)

    def reload(
        self,
        model: torch.nn.Module,
        optim: torch.optim.Optimizer,
        reference: torch.nn.Module | None,
    ) -> None:
        """What offload() moved back onto the device (a checkpoint loaded meanwhile too)."""
        state = state_tensors(model, optim, reference)  # everything off the device
        back = {
            k: t.to(self.device, non_blocking=True)
            for k, t in state.items()
            if t.device != self.device
        }
        torch.cuda.synchronize(self.device)  # the host buffers are free for the next offload
        install_state(model, optim, reference, back)
        self.moved = []
