"""Page-locked host memory for a trainer's state while it is offloaded."""

from __future__ import annotations

import mmap
import weakref

import torch

StateKey = tuple[str, ...]  # ("model", name) or ("optim", param index, state key)


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
