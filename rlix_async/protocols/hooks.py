"""The hooks a training loop calls to join a time-shared cluster (the
implementations, :class:`~rlix_async.hooks.ClusterHooks` and
:class:`~rlix_async.hooks.NoHooks`, are in :mod:`rlix_async.hooks`)."""

from __future__ import annotations

from typing import Protocol

from rlix_async.protocols.cache_ref import CacheRef


class PipelineHooks(Protocol):
    async def before_training(self, step: int) -> None: ...
    async def after_training(self, step: int, weights: CacheRef | None) -> None: ...
    async def report_progress(self, target: int, completed: int) -> None: ...
    async def clear_progress(self) -> None: ...
    async def report_pace(self, exclusive_step_s: float) -> None: ...
