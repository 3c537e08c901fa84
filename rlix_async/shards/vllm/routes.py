"""Routing replay, engine side: the experts each mixture-of-experts layer's router
chose for every token vLLM computed as an input, per request, so the trainer can
route its tokens alike (``Group.routes``, protocols/batch.py, says the format).

Two halves:

- :class:`RoutesWorker`, mixed into vLLM's worker (``RlixWorker``): per-instance hooks
  on each MoE layer's router (``MoERunner.router._compute_routing``) and on the model
  runner's ``_model_forward``, which reads the batch layout (request ids, query
  starts, the ``positions`` argument) and files each layer's top-k ids under their
  request and positions. A uint8 slot store parallel to the KV cache keeps the routes
  of every cached token, so a prefix-cache hit gets the routes that produced the KV
  it reuses. Only rank 0 records (tensor-parallel ranks route alike). These are
  private vLLM 0.32 attributes: ``api.check_routes_internals`` checks them at start.
- :class:`RouteTaker`, the engine's: installs the hooks once, then takes each
  finished request's routes (the takes of requests that finish together share one
  ``collective_rpc``), cut to the positions the caller holds.

Python hooks do not run inside CUDA graphs, and vLLM's V2 model runner (CUDA's
default where Triton is installed) has no ``_model_forward`` to hook: on CUDA routes
are recorded only with ``enforce_eager`` and the V1 runner, else the engine says why
not at start (vLLM's own ``enable_return_routed_experts``, V2's, is the way there).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Finished requests whose routes were never taken (their engine gave up on them), kept
# at most this many times the engine's max_num_seqs (at least _MIN_UNTAKEN) before the
# oldest are evicted: a take follows a request's end within a step or two.
_UNTAKEN_PER_SEQ = 2
_MIN_UNTAKEN = 64
# waits on the engine: the hooks installed (one collective_rpc, first request), a take
INSTALL_TIMEOUT_S = 120.0
TAKE_TIMEOUT_S = 120.0


def _external(internal_id: str) -> str:
    """The caller's request id: vLLM 0.32 appends "-" and 8 random characters
    (v1/engine/input_processor.py, assign_request_id)."""
    return internal_id.rsplit("-", 1)[0]


class _RequestRoutes:
    """One request's routes by position, uint8 [positions, layers, k], grown as it runs."""

    def __init__(self, row: tuple[int, int]) -> None:
        self.rows = np.zeros((64, *row), np.uint8)
        self.seen = np.zeros(64, bool)
        self.covered = 0  # every position below was routed (or read from the store)

    def put(self, positions: np.ndarray, rows: np.ndarray) -> None:
        end = int(positions.max()) + 1
        if end > len(self.seen):  # doubling: a long decode reallocates log(n) times
            size = max(end, 2 * len(self.seen))
            grown = np.zeros((size, *self.rows.shape[1:]), np.uint8)
            grown[: len(self.rows)] = self.rows
            seen = np.zeros(size, bool)
            seen[: len(self.seen)] = self.seen
            self.rows, self.seen = grown, seen
        self.rows[positions] = rows  # a recomputed position (preemption) keeps the latest
        self.seen[positions] = True

    def taken(self) -> dict[str, Any]:
        """``first`` position routed, ``n`` positions from there without a gap, and
        their ``routes`` (bytes, C order)."""
        if not self.seen.any():
            return {"first": 0, "n": 0, "routes": b""}
        first = int(self.seen.argmax())
        gaps = np.flatnonzero(~self.seen[first:])
        n = int(gaps[0]) if len(gaps) else len(self.seen) - first
        return {"first": first, "n": n, "routes": self.rows[first : first + n].tobytes()}


class _Recorder:
    """A worker's routes: what its hooks filed, by vLLM's internal request id."""

    def __init__(self, layer_ids: list[int], k: int, untaken_cap: int) -> None:
        self.layer_ids = layer_ids  # decoder-layer index of each MoE layer, in order
        self.k = k
        self.active = False  # inside a recorded forward
        self.step: dict[int, Any] = {}  # layer id -> this forward's [tokens, k] ids
        self.requests: dict[str, _RequestRoutes] = {}
        # requests vLLM finished whose routes nobody took yet, oldest first
        self.untaken: OrderedDict[str, None] = OrderedDict()
        self.untaken_cap = untaken_cap
        self.store: np.ndarray | None = None  # [KV slots, layers, k]: prefix caching only
        self.block_size = 0
        self.forwards = 0
        self.cached_positions = 0  # read from the store (prefix-cache hits)
        self.evicted = 0  # finished requests dropped untaken
        # why recording stopped (a router lost its hook, rows that fit no request...):
        # the engine serves on, every later take finds nothing (counted as missing)
        self.failed: str | None = None


class RoutesWorker:
    """vLLM worker methods of routing replay (reached with ``collective_rpc``)."""

    model_runner: Any  # vLLM's worker attribute
    rank: int  # vLLM's worker attribute: this worker's global rank

    def rlix_routes_install(self) -> dict[str, Any]:
        """Hook every MoE layer's router and the model runner (once). Returns the MoE
        ``layers`` (decoder-layer indices, in order), ``k`` and ``off``: why nothing
        is recorded (None: recording; a rank other than 0 records nothing, and says
        so without a reason)."""
        runner = self.model_runner
        recorder = getattr(runner, "_rlix_routes", None)
        if recorder is not None:
            return {"layers": recorder.layer_ids, "k": recorder.k, "off": None}
        moe = _moe_runners(runner.get_model())
        why = _why_not_recordable(runner, moe)
        if why is not None:
            return {"layers": [], "k": 0, "off": why}
        k = int(runner.model_config.hf_text_config.num_experts_per_tok)
        layer_ids = sorted(m.layer_id for m in moe)
        if getattr(self, "rank", 0) != 0:
            return {"layers": layer_ids, "k": k, "off": None}
        max_seqs = runner.scheduler_config.max_num_seqs
        recorder = _Recorder(layer_ids, k, max(_MIN_UNTAKEN, _UNTAKEN_PER_SEQ * max_seqs))
        if runner.cache_config.enable_prefix_caching:
            table = runner.input_batch.block_table[0]
            recorder.block_size = table.block_size
            slots = runner.kv_cache_config.num_blocks * table.block_size
            recorder.store = np.zeros((slots, len(layer_ids), k), np.uint8)
        for m in moe:
            m.router._compute_routing = _hooked_router(recorder, m.router, m.layer_id)
        runner._model_forward = _hooked_forward(recorder, runner, runner._model_forward)
        runner._rlix_routes = recorder
        return {"layers": layer_ids, "k": k, "off": None}

    def rlix_routes_take(
        self, request_ids: list[str], drop: list[str] | tuple[str, ...] = ()
    ) -> dict[str, dict[str, Any]]:
        """The routes of these (external) request ids, forgotten here, by id: ``first``
        (the first position routed), ``n`` positions from there, ``routes`` bytes of
        uint8 [n, layers, k]. An id with nothing recorded is absent. ``drop``: ids
        whose routes are forgotten unread (cancelled requests)."""
        recorder: _Recorder | None = getattr(self.model_runner, "_rlix_routes", None)
        if recorder is None:
            return {}
        wanted, dropped = set(request_ids), set(drop)
        out: dict[str, dict[str, Any]] = {}
        for internal in list(recorder.requests):
            external = _external(internal)
            if external in wanted or external in dropped:
                routes = recorder.requests.pop(internal)
                recorder.untaken.pop(internal, None)
                if external in wanted:
                    out[external] = routes.taken()
        return out

    def rlix_routes_stats(self) -> dict[str, Any]:
        """Counters: forwards recorded, requests held (and finished untaken), positions
        read from the slot store, requests evicted untaken, the store's bytes."""
        recorder: _Recorder | None = getattr(self.model_runner, "_rlix_routes", None)
        if recorder is None:
            return {}
        return {
            "forwards": recorder.forwards,
            "held": len(recorder.requests),
            "untaken": len(recorder.untaken),
            "cached_positions": recorder.cached_positions,
            "evicted": recorder.evicted,
            "store_bytes": 0 if recorder.store is None else int(recorder.store.nbytes),
        }


def _moe_runners(model: Any) -> list[Any]:
    from rlix_async.shards.vllm import api as vllm_api

    moe_type = vllm_api.MoERunner
    return [m for m in model.modules() if isinstance(m, moe_type)]


def _why_not_recordable(runner: Any, moe: list[Any]) -> str | None:
    """Why this model's routes cannot be recorded here (None: they can)."""
    from rlix_async.shards.vllm import api as vllm_api

    if not isinstance(runner, vllm_api.GPUModelRunner):  # CUDA's default with Triton
        return (
            f"vLLM's {type(runner).__name__} is not the V1 model runner whose forward is "
            "hooked (VLLM_USE_V2_MODEL_RUNNER=0 selects it)"
        )
    if not moe:
        return "a dense model (no mixture-of-experts layers)"
    import vllm.envs

    if vllm.envs.VLLM_DISABLE_REQUEST_ID_RANDOMIZATION:  # (_external reads the suffix)
        return "VLLM_DISABLE_REQUEST_ID_RANDOMIZATION hides the caller's request ids"
    if any(m.is_monolithic for m in moe):
        return "its MoE kernel is monolithic (it routes inside the kernel, unhooked)"
    experts = runner.model_config.hf_text_config
    n = getattr(experts, "num_experts", None) or getattr(experts, "num_local_experts", 0)
    if int(n or 0) > 255:  # (255 marks a position without a route: train/packing.py)
        return f"{n} experts do not fit the routes' uint8 ids"
    if runner.uses_mrope:
        return "its positions are multimodal (M-RoPE), not one per token"
    groups = len(runner.kv_cache_config.kv_cache_groups)
    if runner.cache_config.enable_prefix_caching and groups != 1:
        return f"{groups} KV cache groups (the slot store follows one)"
    return None


def _hooked_router(recorder: _Recorder, router: Any, layer_id: int) -> Callable[..., Any]:
    """``router._compute_routing`` that also files the top-k ids it chose, ranked as
    the router ranks them: by logit, descending (softmax is monotone; vLLM's CPU
    router takes its top k unsorted); ties keep the lower expert id first."""
    import torch

    compute = router._compute_routing

    def hooked(hidden_states: Any, router_logits: Any, *args: Any, **kwargs: Any) -> Any:
        weights, ids = compute(hidden_states, router_logits, *args, **kwargs)
        if recorder.active:
            chosen = router_logits.float().gather(1, ids.long())
            order = torch.sort(chosen, dim=1, descending=True, stable=True).indices
            recorder.step[layer_id] = ids.long().gather(1, order).to(torch.uint8)
        return weights, ids

    return hooked


def _hooked_forward(recorder: _Recorder, runner: Any, forward: Any) -> Callable[..., Any]:
    """``runner._model_forward`` that files the forward's routes under each request's
    positions (rows past the batch's last query start are padding)."""

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if recorder.failed is not None:
            return forward(*args, **kwargs)
        batch = runner.input_batch
        num_reqs = batch.num_reqs
        req_ids = list(batch.req_ids[:num_reqs])
        starts = runner.query_start_loc.np[: num_reqs + 1].copy()
        positions = kwargs.get("positions")
        recorder.step = {}
        recorder.active = True
        try:
            out = forward(*args, **kwargs)
        finally:
            recorder.active = False
        try:
            _file_forward(recorder, runner, req_ids, starts, positions)
        except Exception as exc:  # a diagnostic's failure must not stop the engine
            recorder.failed = f"{type(exc).__name__}: {exc}"
            recorder.requests.clear()
            recorder.untaken.clear()
            log.warning("routing replay: recording stopped: %s", recorder.failed)
        recorder.step = {}
        return out

    return hooked


def _file_forward(
    recorder: _Recorder, runner: Any, req_ids: list[str], starts: np.ndarray, positions: Any
) -> None:
    """A forward's routes, checked, filed under its requests (rows past the batch's
    last query start are padding)."""
    import torch

    n = int(starts[-1]) if req_ids else 0
    if n <= 0:
        return
    if len(recorder.step) != len(recorder.layer_ids):
        raise RuntimeError(
            f"{len(recorder.step)} of {len(recorder.layer_ids)} MoE layers routed this "
            "forward (a router lost its hook)"
        )
    if positions is None or positions.dim() != 1:
        raise RuntimeError("the forward had no per-token positions")
    pos = positions[:n].cpu().numpy().astype(np.int64)
    rows = torch.stack([recorder.step[i][:n] for i in recorder.layer_ids], 1)
    _file(recorder, runner, req_ids, starts, pos, rows.cpu().numpy())


def _file(
    recorder: _Recorder,
    runner: Any,
    req_ids: list[str],
    starts: np.ndarray,
    pos: np.ndarray,
    rows: np.ndarray,
) -> None:
    """One forward's rows [tokens, layers, k] under their requests and positions; the
    slot store takes them too, and a request's first rows after a prefix-cache hit
    bring the cached positions' routes from it."""
    recorder.forwards += 1
    spans = [(rid, int(starts[i]), int(starts[i + 1]), i) for i, rid in enumerate(req_ids)]
    spans = [span for span in spans if span[2] > span[1]]
    store, bs = recorder.store, recorder.block_size
    table = runner.input_batch.block_table[0].block_table.np if store is not None else None

    def slots(i: int, positions: np.ndarray) -> np.ndarray:
        """Request ``i``'s KV slots of ``positions`` (its block table's blocks)."""
        assert table is not None
        return table[i, positions // bs].astype(np.int64) * bs + positions % bs

    if store is not None:
        # every request's rows first: one may hit blocks another computes in this forward
        for _, s, e, i in spans:
            store[slots(i, pos[s:e])] = rows[s:e]
    for rid, s, e, i in spans:
        routes = recorder.requests.get(rid)
        if routes is None:
            routes = recorder.requests[rid] = _RequestRoutes((len(recorder.layer_ids), recorder.k))
        if store is not None and pos[s] > routes.covered:
            gap = np.arange(routes.covered, pos[s])  # computed from cached KV: its routes
            routes.put(gap, store[slots(i, gap)])
            recorder.cached_positions += len(gap)
        routes.put(pos[s:e], rows[s:e])
        routes.covered = max(routes.covered, int(pos[e - 1]) + 1)
    _evict_untaken(recorder, runner.requests)


def _evict_untaken(recorder: _Recorder, live: dict[str, Any]) -> None:
    """Bound what requests nobody takes leave behind: those vLLM has finished (no
    longer in its runner's requests) wait for their take, the oldest evicted past
    the cap (counted; their take then finds nothing and the engine counts it)."""
    for rid in recorder.requests:
        if rid not in live and rid not in recorder.untaken:
            recorder.untaken[rid] = None
    while len(recorder.untaken) > recorder.untaken_cap:
        rid, _ = recorder.untaken.popitem(last=False)
        recorder.requests.pop(rid, None)
        if not recorder.evicted:
            log.warning("routing replay: routes of finished request %s never taken", rid)
        recorder.evicted += 1


class RouteTaker:
    """The engine's side of routing replay: the hooks installed once, each finished
    request's routes taken (batched), cut to the positions its caller holds."""

    def __init__(self, llm: Any, off: str | None) -> None:
        self.llm = llm
        self.off = off  # why nothing is recorded (None: recording, once installed)
        self.missing = 0  # results returned without routes while recording
        self.rounds = 0  # collective_rpc takes sent
        self.row_bytes = 0  # layers x k: bytes per position
        self._installing: asyncio.Future[None] | None = None
        self._waiting: dict[str, asyncio.Future[dict[str, Any] | None]] = {}
        self._drops: list[str] = []
        self._flushing: asyncio.Task[None] | None = None

    async def ready(self) -> bool:
        """Install the hooks (the first call; later ones wait for it); whether routes
        are recorded."""
        if self.off is not None:
            return False
        if self._installing is None:
            self._installing = asyncio.ensure_future(self._install())
        try:
            await asyncio.wait_for(asyncio.shield(self._installing), INSTALL_TIMEOUT_S)
        except TimeoutError:
            self.off = f"installing the hooks took over {INSTALL_TIMEOUT_S:.0f} s"
            log.warning("routing replay: routes not recorded: %s", self.off)
        return self.off is None

    async def _install(self) -> None:
        first = (await self.llm.collective_rpc("rlix_routes_install"))[0]
        if first["off"] is not None:
            self.off = first["off"]
            log.warning("routing replay: routes not recorded: %s", self.off)
            return
        self.row_bytes = len(first["layers"]) * first["k"]

    async def take(self, request_id: str, positions: int) -> bytes:
        """The routes of a finished request, positions 0 .. ``positions`` - 1 (its
        prompt and tokens but the last); b"" (counted in ``missing``) when the worker
        did not record them all from position 0."""
        if self.off is not None or self._installing is None:
            return b""
        future = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        if self._flushing is None or self._flushing.done():
            self._flushing = asyncio.ensure_future(self._flush())
        try:
            got = await asyncio.wait_for(future, TAKE_TIMEOUT_S)
        except TimeoutError:
            got = None  # counted below: a result without routes, never a stuck request
        if positions <= 0:
            return b""
        if got is None or got["first"] != 0 or got["n"] < positions:
            self.missing += 1
            return b""
        return bytes(memoryview(got["routes"])[: positions * self.row_bytes])

    def forget(self, request_id: str) -> None:
        """A request that ended without a take (cancelled): its routes are dropped
        with the next take (the worker evicts them anyway if none comes)."""
        if self.off is None and self._installing is not None:
            self._drops = [*self._drops[-4095:], request_id]

    async def _flush(self) -> None:
        """Send the waiting takes, with the drops, as one collective_rpc; again while
        more arrived meanwhile."""
        await asyncio.sleep(0)  # requests finishing in the same step join this round
        while self._waiting:
            batch, self._waiting = self._waiting, {}
            drops, self._drops = self._drops, []
            self.rounds += 1
            answers: dict[str, Any] = {}
            try:
                ranks = await self.llm.collective_rpc("rlix_routes_take", args=(list(batch), drops))
                answers = ranks[0] if ranks else {}
            except Exception as exc:  # the engine failed: each request fails with it
                for future in batch.values():
                    if not future.done():
                        future.set_exception(exc)
                continue
            finally:  # cancelled, or anything else: no caller waits on a future forever
                for rid, future in batch.items():
                    if not future.done():  # its caller may have been cancelled meanwhile
                        future.set_result(answers.get(rid))
