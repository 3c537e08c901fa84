"""An inference engine from outside the package: a transformers causal LM, decoding
token by token. Plugged in by config alone (rlix_async/shards/engines.py says what an
engine backend has)::

    engine:
      kind: custom
      custom: examples/engines/hf_engine.py:BACKEND
      max_model_len: 128      # the common keys, as every engine kind reads them

What it shows: an engine kind says for itself whether it runs on CUDA (here: where the
shard sees CUDA devices, so it gets the GPU defaults: bfloat16, built at the first
wake), checks it can run, builds its engine, and loads each synced version through the
package's transports (shared memory on the trainer's node, tcp from other nodes) into
a private copy first, so a failed sync leaves the old weights serving. The engine
implements rlix_async.protocols.engine.ShardEngine: streaming generation whose
log-probs are of the sampling distribution (after temperature and top-p, as the
trainer recomputes them), abort, pause (keep or abort), sleep and wake. It decodes one
token of one request at a time (no batching, no paged KV cache): a reference and a
starting point, not a fast engine.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlix_async.models.hf import load_hf_model
from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.engine import GenerationChunk, PauseMode, ShardEngine, ToolCallFormat
from rlix_async.protocols.generation import Sampling
from rlix_async.security import ClientKeys
from rlix_async.shards.engines import HERMES_ONLY, EngineStart, EngineUnavailable, hermes_format
from rlix_async.train.algo import sampling_log_softmax
from rlix_async.weights.staging import stage_version

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class _Request:
    aborted: bool = False
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


class HfEngine:
    def __init__(
        self,
        model: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        seed: int = 0,
        keys: ClientKeys | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.model = load_hf_model(model, DTYPES[dtype]).to(self.device).eval()
        self.seed = seed
        self.keys = keys  # this shard's pair, to pull versions from other nodes
        self.weight_version: int | None = None
        self.layout: Layout | None = None
        self.loads: list[tuple[int, float]] = []  # (version, seconds) of each load
        self._step = asyncio.Lock()  # one forward pass or weight update at a time
        self._paused = False
        self._changed = asyncio.Condition()  # a pause, resume or abort happened
        self._sleeping: set[str] = set()
        self._running: dict[str, _Request] = {}
        self._ids = itertools.count()

    # --- generation ----------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: Sampling, *, request_id: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        if sampling.stop:
            raise ValueError("stop strings: this engine matches stop token ids only")
        rid = request_id or f"r{next(self._ids)}"
        request = self._running[rid] = _Request()
        # its own stream per request, the same in every run (str hashes vary by process)
        seed = sampling.seed if sampling.seed is not None else self.seed + zlib.crc32(rid.encode())
        generator = torch.Generator().manual_seed(seed)
        ids, past = torch.tensor([prompt_ids], device=self.device), None
        try:
            while len(request.tokens) < sampling.max_tokens:
                async with self._changed:  # a pause in keep mode freezes it here
                    await self._changed.wait_for(lambda: not self._paused or request.aborted)
                if request.aborted:
                    yield self._chunk(request, True, "abort")
                    return
                async with self._step:
                    version = self.weight_version
                    logits, past = await asyncio.to_thread(self._forward, ids, past)
                token, logp = self._sample(logits, sampling, generator)
                request.tokens.append(token)
                request.logprobs.append(logp)
                ids = torch.tensor([[token]], device=self.device)
                if token in sampling.stop_token_ids:
                    yield self._chunk(request, True, "stop", version)
                    return
                yield self._chunk(
                    request, len(request.tokens) >= sampling.max_tokens, "length", version
                )
        finally:
            self._running.pop(rid, None)

    def _chunk(
        self, r: _Request, finished: bool, reason: str, version: int | None = None
    ) -> GenerationChunk:
        return GenerationChunk(
            list(r.tokens),
            list(r.logprobs),
            finished,
            version if version is not None else self.weight_version,
            reason if finished else None,
        )

    @torch.no_grad()
    def _forward(self, ids: torch.Tensor, past: Any) -> tuple[torch.Tensor, Any]:
        out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
        return out.logits[0, -1].float(), out.past_key_values

    @staticmethod
    def _sample(
        logits: torch.Tensor, sampling: Sampling, generator: torch.Generator
    ) -> tuple[int, float]:
        """A token and its log-prob under the sampling distribution (temperature 0:
        greedy, its log-prob under temperature 1)."""
        if sampling.temperature == 0:
            logp = torch.log_softmax(logits, -1)
            token = int(logp.argmax())
            return token, float(logp[token])
        logp = sampling_log_softmax(logits, temperature=sampling.temperature, top_p=sampling.top_p)
        token = int(torch.multinomial(logp.exp(), 1, generator=generator))
        return token, float(logp[token])

    async def abort_all(self) -> int:
        for r in self._running.values():
            r.aborted = True
        await self._notify()
        return len(self._running)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def num_running(self) -> int:
        return len(self._running)

    async def pause(self, mode: PauseMode = "abort") -> None:
        """``keep``: running requests freeze before their next token, new ones wait;
        ``abort``: running requests end too."""
        self._paused = True
        if mode == "abort":
            await self.abort_all()

    async def resume(self) -> None:
        if not self._sleeping:
            self._paused = False
            await self._notify()

    # --- weights -------------------------------------------------------------------------

    async def load_version(self, ref: CacheRef) -> None:
        """The version into a private copy first (a stream that breaks halfway leaves the
        model as it was), then into the model between two decoding steps."""
        t0 = time.perf_counter()
        ref, self.layout, named = await asyncio.to_thread(
            stage_version, ref, self.layout, keys=self.keys
        )
        async with self._step:
            state = dict(named)
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            tied = getattr(self.model.config, "tie_word_embeddings", False)
            missing = [k for k in missing if not (tied and k == "lm_head.weight")]
            if unexpected or missing:
                raise RuntimeError(f"version {ref.version} does not fit the model "
                                   f"(missing {missing[:3]}, unexpected {unexpected[:3]})")  # fmt: skip
            self.weight_version = ref.version
        self.loads.append((ref.version, time.perf_counter() - t0))

    # --- sleep and wake (CUDA: weights to host memory at level 1, dropped at level 2) ----

    async def sleep(self, level: int = 2) -> None:
        await self.pause("abort")
        self._sleeping = {"weights", "kv_cache"}
        if self.device.type == "cuda":
            async with self._step:
                self.model.to("cpu" if level == 1 else "meta")
                torch.cuda.empty_cache()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        wanted = set(tags) if tags is not None else {"weights", "kv_cache"}
        if "weights" in wanted & self._sleeping and self.device.type == "cuda":
            async with self._step:
                on_meta = next(self.model.parameters()).device.type == "meta"
                # level 2 dropped them: storage only, the worker syncs a version next
                self.model = (
                    self.model.to_empty(device=self.device)
                    if on_meta
                    else self.model.to(self.device)
                )
        self._sleeping -= wanted
        await self.resume()  # only once nothing sleeps

    def shutdown(self) -> None:
        self._running.clear()


class HfEngineBackend:
    """``engine.kind: custom`` with ``custom: examples/engines/hf_engine.py:BACKEND``."""

    binding_variable: str | None = None  # torch's threads: OMP_NUM_THREADS, as set

    def check_installed(self, adapters: bool) -> str | None:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise EngineUnavailable(
                "the hf engine needs transformers (pip install transformers)"
            ) from None
        if adapters:
            raise EngineUnavailable("the hf engine serves no LoRA adapters (base groups need vllm)")
        return None

    def uses_cuda(self, cuda_devices: int) -> bool:
        return cuda_devices > 0

    def environment(self) -> dict[str, str]:
        return {}

    def for_base_group(self, engine: Any, largest_group: int) -> Any:
        return engine  # refused by check_installed: no adapters

    def build(self, start: EngineStart) -> ShardEngine:
        if start.model is None or not Path(start.model, "config.json").is_file():
            raise EngineUnavailable(f"the hf engine needs a model directory, not {start.model}")
        keys = (
            ClientKeys.load(start.keys_dir, start.key_name or "client") if start.keys_dir else None
        )
        return HfEngine(
            start.model,
            dtype=start.engine.dtype,  # resolved for the device: bfloat16 on CUDA
            device="cuda:0" if start.cuda else "cpu",  # the shard sees its own devices only
            seed=start.seed,
            keys=keys,
        )

    def tool_parsers(self) -> frozenset[str] | None:
        return HERMES_ONLY

    def tool_calls(self, parser: str | None, tokenizer: Any) -> ToolCallFormat:
        return hermes_format(parser, tokenizer)  # the package's Hermes parser


BACKEND = HfEngineBackend()
