"""An engine built at a shard's first wake (``engine.load: first_wake``): on CUDA,
engines sharing a GPU must never load at once, so each loads only once the
coordinator has given its shard the devices."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.engine import AdapterEngine, GenerationChunk, PauseMode, ShardEngine
from rlix_async.protocols.generation import Sampling


class FirstWakeEngine:
    """An engine built at its first wake (``engine.load: first_wake``), when the
    coordinator has given the shard its devices; until then it holds nothing, runs
    nothing and its sleeps are no-ops. Built off the event loop, so heartbeats go
    on while a model loads."""

    def __init__(self, build: Callable[[], ShardEngine]) -> None:
        self._build = build
        self.engine: ShardEngine | None = None

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    @property
    def weight_version(self) -> int | None:
        return self.engine.weight_version if self.engine is not None else None

    @weight_version.setter
    def weight_version(self, version: int | None) -> None:
        self._built().weight_version = version

    def _built(self) -> ShardEngine:
        if self.engine is None:
            raise RuntimeError("the engine is built at the shard's first wake")
        return self.engine

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        extra = {"adapter": adapter} if adapter is not None else {}
        return self._built().generate(prompt_ids, sampling, request_id=request_id, **extra)

    @property
    def adapter_versions(self) -> dict[str, int]:
        engine = self.engine
        return engine.adapter_versions if engine is not None else {}  # type: ignore[attr-defined]

    async def load_adapter(self, name: str, ref: CacheRef) -> None:
        engine: AdapterEngine = self._built()  # type: ignore[assignment]  # a group's engine
        await engine.load_adapter(name, ref)

    async def load_version(self, ref: CacheRef) -> int | None:
        return await self._built().load_version(ref)

    async def abort_all(self) -> int:
        return await self.engine.abort_all() if self.engine is not None else 0

    def num_running(self) -> int:
        return self.engine.num_running() if self.engine is not None else 0

    async def pause(self, mode: PauseMode = "abort") -> None:
        if self.engine is not None:
            await self.engine.pause(mode)

    async def resume(self) -> None:
        if self.engine is not None:
            await self.engine.resume()

    async def sleep(self, level: int = 2) -> None:
        if self.engine is not None:
            await self.engine.sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.engine is None:
            self.engine = await asyncio.to_thread(self._build)  # awake once built
            return
        await self.engine.wake_up(tags)

    def shutdown(self) -> None:
        if self.engine is not None:
            shutdown_engine(self.engine)


def shutdown_engine(engine: ShardEngine) -> None:
    shutdown = getattr(engine, "shutdown", None)
    if shutdown is not None:
        shutdown()
