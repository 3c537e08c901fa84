"""CPU-compat patches for megatron-core 0.16.1 (tests and demos on machines without CUDA).

Never applied on GPU machines: ``apply()`` does nothing when CUDA is present.
Two spots of megatron-core assume a GPU:

- ``torch.cuda.current_device()`` is used as a device (rotary embeddings move
  their frequencies there): on CPU it answers ``"cpu"``.
- The CUDA RNG tracker keeps CUDA generator states (``add``, and ``fork`` around
  dropout in attention). On CPU it keeps CPU generator states instead and swaps
  them in and out of the CPU generator, with Megatron's own ``fork`` and its
  checks: a tracker nobody seeded (``model_parallel_cuda_manual_seed``) raises
  "cuda rng state ... is not added" here as it does on CUDA, so a trainer that
  forgets to seed fails on CPU too instead of only at its first CUDA forward.

The default causal mask is built on "cuda" too; callers pass an explicit mask
instead (see ``MegatronTrainer.forward_logits``).

Pipeline parallel adds three more, each confined to the module that needs it:

- the schedules allocate their token counter with ``torch.zeros(..., device="cuda")``
  and ``p2p_communication`` calls ``torch.cuda.synchronize()`` after exchanging
  shapes: both modules see a ``torch`` whose ``zeros`` maps "cuda" to the host and
  whose ``cuda.synchronize`` has nothing to wait for;
- with tied embeddings on different stages, ``setup_embeddings_and_output_layer``
  moves the last stage's copy ``.cuda()`` before summing it over the embedding group:
  during that call ``Tensor.cuda`` leaves a tensor where it is.
"""

from __future__ import annotations

import types
from typing import Any

import torch

_applied = False


def apply() -> None:
    global _applied
    if _applied or torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]

    def get_state(clone: bool = False, graph_safe: bool = False, **_: Any) -> torch.Tensor:
        return torch.get_rng_state()

    def set_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
        torch.set_rng_state(new_state)

    def add(self: Any, name: str, seed: int) -> None:
        # CudaRNGStatesTracker.add with a CPU generator's state in place of CUDA's
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"cuda rng state {name} already exists")
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    mrandom._get_cuda_rng_state = get_state
    mrandom._set_cuda_rng_state = set_state
    mrandom.CudaRNGStatesTracker.add = add  # type: ignore[method-assign]
    _pipeline_on_host()
    _applied = True


class _HostCuda(types.SimpleNamespace):
    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def synchronize(*_: Any, **__: Any) -> None:
        return None


class _HostTorch(types.ModuleType):
    """``torch`` as megatron-core's schedules and p2p code see it on a host without CUDA."""

    cuda = _HostCuda()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def zeros(*args: Any, device: Any = None, **kw: Any) -> torch.Tensor:
        return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kw)


def _pipeline_on_host() -> None:
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.pipeline_parallel import p2p_communication, schedules

    host = _HostTorch("torch")
    schedules.torch = host  # type: ignore[attr-defined]
    p2p_communication.torch = host  # type: ignore[attr-defined]
    setup = LanguageModule.setup_embeddings_and_output_layer

    def setup_on_host(self: Any) -> None:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *a, **k: t  # type: ignore[method-assign,assignment]
        try:
            setup(self)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    LanguageModule.setup_embeddings_and_output_layer = setup_on_host  # type: ignore[method-assign]


def alltoall_on_host() -> None:
    """Megatron's all-to-all token dispatcher on a host without CUDA (CPU only, as
    ``apply``): its class creates one ``torch.cuda.Stream()`` for all instances and
    ``_maybe_dtoh_and_synchronize`` waits on CUDA streams and events. On the host
    there is nothing to copy or wait for, but the GPU path also turns the split sizes
    into host sequences there (``maybe_move_tensor_to_cpu`` skips host tensors), and
    ``all_to_all_single`` refuses tensors for them: they become lists at that point."""
    if torch.cuda.is_available():
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if getattr(MoEAlltoAllTokenDispatcher, "_rlix_on_host", False):
        return
    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # not None: no Stream() built

    def host_dtoh(self: Any, point: Any, tokens_per_expert: Any = None) -> Any:
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                if isinstance(value := getattr(self, name), torch.Tensor):
                    setattr(self, name, value.tolist())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_dtoh  # type: ignore[method-assign]
    MoEAlltoAllTokenDispatcher._rlix_on_host = True  # type: ignore[attr-defined]
