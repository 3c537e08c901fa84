"""LoRA adapters in the production engine: a base group's shard serves each member's
requests with that member's adapter (issue 21).

An adapter version travels through the rlix weight cache like full weights do and is
pulled the same way, inside vLLM's worker process (shared memory on the owner's node,
else tcp with this shard's keys). The cache holds peft's adapter state dict without
the adapter name (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``,
[r, in]; ``...lora_B.weight``, [out, r]) with lora_B already multiplied by alpha / r,
so it is served with lora_alpha = r (scaling 1).

No disk round trip: the worker extension (:class:`RlixLoraWorker`, part of vLLM's
``worker_extension_cls``, :mod:`rlix_async.shards.vllm.worker_extension`) builds vLLM's
``LoRAModel`` from the staged tensors and registers it in the worker's LoRA
manager, which is what ``add_lora`` does after reading a directory (vLLM has no
public API for it: :mod:`rlix_async.shards.vllm.api` says why and checks it at
start). Each load gets a fresh lora id, and a LoRARequest name of its own: a
version replaced in place would change the weights under requests decoding with it,
and vLLM tells LoRARequests apart by name alone (their equality and hash: two ids with
one name running at once collapse in the worker's set of active adapters, which kills
the engine; its prefix cache keys KV blocks by name and path too). The old id stays
registered until the last request using it ends (:class:`Adapters`): a running request
whose id is gone makes vLLM's worker reload it from its path, and ours has none, which
also kills the engine.

A load runs in three steps so that it stalls nobody: the pull and the checks run in a
thread of vLLM's worker process (utility calls run between decoding steps and would
hold every request for the whole pull), the engine polls until they are done, then one
short call registers the staged tensors.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from rlix_async.config.lora import LORA_TARGETS, EngineLoraConfig
from rlix_async.protocols.cache_ref import CacheRef

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

DEFAULT_MAX_LORAS = 4  # the config leaves max_loras to its caller; a bare engine gets this
# Registered versions per batch slot. A replaced version stays registered while requests
# still decode with it; vLLM's LRU would evict one past max_cpu_loras behind our back,
# so a load that would need more is refused instead (see Adapters.load).
CPU_LORAS_PER_SLOT = 4
_POLL_S = (0.001, 0.002, 0.005, 0.01, 0.02)  # then every 20 ms
# peft's names (no adapter name) of the Llama-family projections vLLM serves LoRA on
_NAME = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\."
    r"(?:self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
    r"\.lora_([AB])\.weight"
)
# Paths vLLM never reads while the id is registered; absolute, so that a bug reloading
# one fails at once instead of asking a model hub for it.
_NO_PATH = "/rlix-in-memory-adapter"


class AdapterError(ValueError):
    """An adapter version that cannot be served (the previous one serves on)."""


def engine_args(lora: EngineLoraConfig) -> dict[str, Any]:
    """vLLM engine arguments of a shard that serves adapters."""
    max_loras = lora.max_loras or DEFAULT_MAX_LORAS
    return dict(
        enable_lora=True,
        max_lora_rank=lora.max_lora_rank,
        max_loras=max_loras,
        max_cpu_loras=max_loras * CPU_LORAS_PER_SLOT,
    )


# --- what the cache must hold ---------------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    layers: int
    hidden: int
    intermediate: int
    q_out: int  # heads * head_dim
    kv_out: int  # kv heads * head_dim

    @classmethod
    def of(cls, hf_config: Any) -> ModelDims:
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        return cls(
            hf_config.num_hidden_layers,
            hf_config.hidden_size,
            hf_config.intermediate_size,
            heads * head_dim,
            kv_heads * head_dim,
        )

    def in_out(self, module: str) -> tuple[int, int]:
        return {
            "q_proj": (self.hidden, self.q_out),
            "k_proj": (self.hidden, self.kv_out),
            "v_proj": (self.hidden, self.kv_out),
            "o_proj": (self.q_out, self.hidden),
            "gate_proj": (self.hidden, self.intermediate),
            "up_proj": (self.hidden, self.intermediate),
            "down_proj": (self.intermediate, self.hidden),
        }[module]


def check_adapter(
    shapes: Mapping[str, tuple[int, ...]], dims: ModelDims, max_rank: int
) -> tuple[int, list[str]]:
    """The rank and target modules of an adapter state dict, or a one-line
    :class:`AdapterError`: every name a lora_A/lora_B of a Llama projection, each
    module with both, one rank <= ``max_rank``, shapes those of the base model's layers."""
    if not shapes:
        raise AdapterError("the version holds no tensors")
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    for name, shape in shapes.items():
        m = _NAME.fullmatch(name)
        if m is None:
            raise AdapterError(
                f"{name!r} is not the lora_A/lora_B weight of a Llama projection "
                f"({', '.join(LORA_TARGETS)})"
            )
        layer, module, ab = int(m[1]), m[2] or m[3], m[4]
        if layer >= dims.layers:
            raise AdapterError(f"{name!r}: the model has {dims.layers} layers")
        if len(shape) != 2:
            raise AdapterError(f"{name!r} has shape {list(shape)}, not a matrix")
        pairs.setdefault((layer, module), {})[ab] = shape
    ranks = set()
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where} has lora_{''.join(ab)} only")
        (r, n_in), (n_out, r_b) = ab["A"], ab["B"]
        if (n_in, n_out) != dims.in_out(module) or r != r_b:
            want_in, want_out = dims.in_out(module)
            raise AdapterError(
                f"{where}: lora_A {list(ab['A'])} and lora_B {list(ab['B'])} do not fit "
                f"the layer ([r, {want_in}] and [{want_out}, r])"
            )
        ranks.add(r)
    if len(ranks) != 1:
        raise AdapterError(f"the modules have different ranks {sorted(ranks)}")
    rank = ranks.pop()
    if rank < 1:
        raise AdapterError("rank 0: lora_A has no rows")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} > the engine's max_lora_rank {max_rank}")
    return rank, sorted({module for _, module in pairs})


# --- inside vLLM's worker process -----------------------------------------------------


@dataclass
class _Staged:
    version: int
    tensors: dict[str, torch.Tensor]
    rank: int
    targets: list[str]
    nbytes: int
    stage_ms: float


@dataclass
class _WorkerState:
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="rlix-lora")
    )
    staging: dict[int, Future[_Staged]] = field(default_factory=dict)
    layouts: dict[str, Any] = field(default_factory=dict)  # pipeline -> its cache's Layout


def _stage(
    ref: CacheRef,
    dims: ModelDims,
    max_rank: int,
    keys_dir: str | None,
    key_name: str,
    layouts: dict[str, Any],
) -> _Staged:
    """In the staging thread: a private, checked copy of the adapter version."""
    from rlix_async.security import ClientKeys
    from rlix_async.weights.staging import stage_version

    t0 = time.perf_counter()
    keys = ClientKeys.load(keys_dir, key_name or "client") if keys_dir else None
    got, layouts[ref.pipeline], named = stage_version(ref, layouts.get(ref.pipeline), keys=keys)
    tensors = dict(named)
    for name, t in named:
        if not t.is_floating_point():
            raise AdapterError(f"{name!r} is {t.dtype}, not floating point")
    rank, targets = check_adapter({n: tuple(t.shape) for n, t in named}, dims, max_rank)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return _Staged(got.version, tensors, rank, targets, nbytes, (time.perf_counter() - t0) * 1e3)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


class RlixLoraWorker:
    """Part of the worker extension (:mod:`rlix_async.shards.vllm.worker_extension`); the engine
    calls these with ``collective_rpc``, once per tensor-parallel rank. Failures come back as an
    ``error`` string: a raising call would log a worker traceback for a refused adapter."""

    model_runner: Any
    vllm_config: Any

    def _rlix_lora(self) -> _WorkerState:
        return self.__dict__.setdefault("_rlix_lora_state", _WorkerState())  # type: ignore[no-any-return]

    def rlix_stage_adapter(
        self, lora_id: int, ref: dict[str, Any], keys_dir: str | None, key_name: str
    ) -> None:
        state = self._rlix_lora()
        dims = ModelDims.of(self.vllm_config.model_config.hf_text_config)
        max_rank = self.model_runner.lora_manager.lora_config.max_lora_rank
        state.staging[lora_id] = state.pool.submit(
            _stage,
            msgspec.convert(ref, CacheRef),
            dims,
            max_rank,
            keys_dir,
            key_name,
            state.layouts,
        )

    def rlix_adapter_staged(self, lora_id: int) -> bool:
        future = self._rlix_lora().staging.get(lora_id)
        return future is None or future.done()

    def rlix_add_adapter(self, lora_id: int) -> dict[str, Any]:
        """Register the staged version under ``lora_id``: its version, bytes, times."""
        future = self._rlix_lora().staging.pop(lora_id, None)
        if future is None:
            return {"error": f"lora id {lora_id} was never staged"}
        try:
            staged = future.result()
            t0 = time.perf_counter()
            self._register(lora_id, staged)
        except Exception as exc:
            return {"error": _one_line(exc)}
        return {
            "version": staged.version,
            "bytes": staged.nbytes,
            "stage_ms": staged.stage_ms,
            "add_ms": (time.perf_counter() - t0) * 1e3,
        }

    def rlix_forget_adapter(self, lora_id: int) -> None:
        """Drop what a failed or cancelled load left behind: its staging, its id."""
        future = self._rlix_lora().staging.pop(lora_id, None)
        if future is not None:
            future.cancel()
        self.model_runner.lora_manager.remove_adapter(lora_id)

    def _register(self, lora_id: int, staged: _Staged) -> None:
        """What vLLM's ``WorkerLoRAManager._load_adapter`` and the LRU manager's
        ``add_adapter`` do with a directory, from tensors (vllm 0.32)."""
        from rlix_async.shards.vllm import api as vllm_api

        worker_manager = self.model_runner.lora_manager
        manager = vllm_api.adapter_manager(worker_manager)
        if lora_id in manager.list_adapters():
            raise AdapterError(f"lora id {lora_id} is taken")
        if len(manager) >= manager.capacity:  # its LRU would evict a version in use
            raise AdapterError(
                f"{len(manager)} adapter versions are registered, max_cpu_loras is "
                f"{manager.capacity}"
            )
        helper = vllm_api.PEFTHelper.from_dict(
            {
                "r": staged.rank,
                "lora_alpha": staged.rank,  # lora_B arrives scaled by alpha / r
                "target_modules": staged.targets,
                "vllm_max_position_embeddings": worker_manager.max_position_embeddings,
            }
        )
        helper.validate_legal(worker_manager.lora_config)
        model = manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = vllm_api.LoRAModel.from_lora_tensors(
            lora_model_id=lora_id,
            tensors=staged.tensors,
            peft_helper=helper,
            device="cpu",  # as vLLM's loader: slots are filled from here on activation
            dtype=worker_manager.lora_config.lora_dtype,
            model_vocab_size=worker_manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        manager.add_adapter(lora)  # registered, not activated: a request activates it


# --- the engine's side ----------------------------------------------------------------


@dataclass(frozen=True)
class Served:
    """One registered adapter version."""

    name: str
    version: int
    lora_id: int
    request: Any  # vllm.lora.request.LoRARequest


class Adapters:
    """Which lora id serves each member's new requests, and the replaced ids that still
    serve running ones (removed when their last request ends)."""

    def __init__(self, llm: Any, capacity: int, keys_dir: str | None, key_name: str) -> None:
        self.llm = llm
        self.capacity = capacity
        self.keys = (keys_dir, key_name)
        self.versions: dict[str, int] = {}  # the engine's adapter_versions
        self.current: dict[str, Served] = {}
        self.retired: set[int] = set()
        self.users: Counter[int] = Counter()
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self.last_load: dict[str, Any] = {}  # the worker's numbers for the last load

    def acquire(self, name: str) -> Served:
        served = self.current.get(name)
        if served is None:
            raise AdapterError(f"adapter {name!r} has no version loaded on this shard")
        self.users[served.lora_id] += 1
        return served

    def release(self, served: Served) -> None:
        self.users[served.lora_id] -= 1
        if self.users[served.lora_id] <= 0:
            del self.users[served.lora_id]
            if served.lora_id in self.retired:
                self._remove_soon(served.lora_id)

    def _remove_soon(self, lora_id: int) -> None:
        # Not awaited in the request's own cleanup (it may be cancelled); vLLM already
        # has the request's abort, sent first, so the engine core sees it before this.
        task = asyncio.ensure_future(self._remove(lora_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _remove(self, lora_id: int) -> None:
        self.retired.discard(lora_id)
        try:
            await self.llm.remove_lora(lora_id)
        except Exception as exc:  # the engine is shutting down or dead: nothing to free
            log.debug("removing lora id %d: %s", lora_id, exc)

    async def load(self, name: str, ref: CacheRef) -> None:
        async with self._lock:
            await self._load(name, ref)

    async def _load(self, name: str, ref: CacheRef) -> None:
        from rlix_async.shards.vllm import api as vllm_api

        where = f"adapter {name} version {ref.version}"
        if len(self.current) + len(self.retired) >= self.capacity:
            raise AdapterError(
                f"{where}: {len(self.retired)} replaced versions still serve running "
                f"requests (max_cpu_loras {self.capacity})"
            )
        lora_id = next(self._ids)
        try:
            await self.llm.collective_rpc(
                "rlix_stage_adapter", args=(lora_id, msgspec.to_builtins(ref), *self.keys)
            )
            for wait in itertools.chain(_POLL_S, itertools.repeat(_POLL_S[-1])):
                if all(await self.llm.collective_rpc("rlix_adapter_staged", args=(lora_id,))):
                    break
                await asyncio.sleep(wait)
            results = await self.llm.collective_rpc("rlix_add_adapter", args=(lora_id,))
            errors = [r["error"] for r in results if "error" in r]
            if errors:
                raise AdapterError(f"{where}: {errors[0]}")
            if len({r["version"] for r in results}) != 1:  # the slot changed between ranks
                raise AdapterError(f"{where}: ranks copied different versions; load again")
        except BaseException:
            # nothing of it may stay registered; shielded, so a cancelled load cleans up
            await asyncio.shield(self._forget(lora_id))
            raise
        version = results[0]["version"]  # newer than asked if the owner overwrote the slot
        self.last_load = results[0]
        request = vllm_api.LoRARequest(f"{name}@{version}#{lora_id}", lora_id, _path(name, lora_id))
        served = Served(name, version, lora_id, request)
        old = self.current.get(name)
        self.current[name] = served
        self.versions[name] = version
        if old is not None:
            self.retired.add(old.lora_id)
            if not self.users[old.lora_id]:  # (a Counter: 0 when absent)
                await self._remove(old.lora_id)

    async def _forget(self, lora_id: int) -> None:
        try:
            await self.llm.collective_rpc("rlix_forget_adapter", args=(lora_id,))
        except Exception as exc:
            log.warning("forgetting lora id %d: %s", lora_id, exc)


def _path(name: str, lora_id: int) -> str:
    # unique per id, like the name (see the module's docstring)
    safe = re.sub(r"[^\w.-]", "_", name)
    return f"{_NO_PATH}/{safe}/{lora_id}"
