"""CPU-compat patches for megatron-core 0.16.1 (tests and demos on machines without CUDA).

Never imported on GPU machines: ``apply()`` does nothing when CUDA is present.
Two spots of megatron-core assume a GPU:

- ``torch.cuda.current_device()`` is used as a device (rotary embeddings move
  their frequencies there): on CPU it answers ``"cpu"``.
- The CUDA RNG tracker's ``fork()`` (used around dropout in attention) needs
  CUDA RNG states: on CPU it is a no-op context (one RNG, no tensor parallelism).

The default causal mask is built on "cuda" too; callers pass an explicit mask
instead (see ``MegatronTrainer.forward_logits``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_applied = False


def apply() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]

    @contextlib.contextmanager
    def _fork(self: object, name: str = "model-parallel-rng") -> Iterator[None]:
        yield

    mrandom.CudaRNGStatesTracker.fork = _fork  # type: ignore[method-assign,assignment]
    _applied = True
