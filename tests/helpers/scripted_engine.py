"""A scripted engine for control-plane tests that need many shards.

TEST DOUBLE: it implements the engine protocol (``rlix_async.protocols.engine``:
generate, abort, running count, pause/resume, sleep/wake, weight updates)
without a model: token ``i`` of a request is ``(sum(prompt) + i) % vocab``,
one per ``token_delay_s``. Use it only where a real engine cannot run (dozens
of shards on a 2-core machine); everything that concerns generation quality
uses vLLM. Shard worker processes load it as a custom engine
(``engine.kind: custom``, ``engine.custom: tests/helpers/scripted_engine.py:ScriptedEngine``);
it is not part of rlix_async.

Sleep and wake follow vLLM V1 (0.32) tag by tag, so that a worker path vLLM would
break on breaks here too:

- A fresh engine is awake, scheduling (``EngineCore.__init__``).
- ``sleep(level, mode="abort")`` is ``EngineCore.sleep``: it pauses the scheduler
  first (``pause_scheduler``: ``abort`` ends every request, ``keep`` freezes them),
  then the executor's ``sleep`` (``v1/executor/abstract.py``
  ``Executor.sleep``), which returns early while ``weights`` is a sleeping tag
  ("Executor is already sleeping": a level-2 sleep after a level-1 one discards
  nothing) and otherwise releases every allocation not already asleep
  (``device_allocator/cumem.py`` ``CuMemAllocator.sleep`` skips asleep ones):
  weights offloaded to host memory at level 1, discarded at level 2 (their
  contents are gone: ``weight_version`` None); the KV cache discarded at both.
  Both tags are then sleeping.
- ``wake_up(tags)`` is ``EngineCore.wake_up``: the executor's ``wake_up`` does
  nothing when nothing sleeps, or when a named tag is not sleeping (the whole call
  is then a no-op with a warning); otherwise it maps the named tags back (weights
  restored from host memory after level 1, contents undefined after level 2). The
  scheduler resumes only once no tag sleeps ("Partial wakes intentionally keep the
  remaining allocations asleep").
- ``pause(mode)`` / ``resume()`` are ``AsyncLLM.pause_generation`` /
  ``resume_generation``, which set the scheduler's pause state whatever sleeps: a
  resume under a sleeping tag unpauses a scheduler whose memory is unmapped. Here
  a request that then decodes raises (on CUDA: an illegal memory access that kills
  the engine), as does a weight load while the weights sleep.

Every transition is recorded in ``transitions`` with the sleeping tags after it
and the device and host bytes the engine would hold then (``weights_bytes``,
``kv_bytes``: a level-1 sleep moves the weights to host memory).

Weight updates are real: ``load_version`` pulls the cached version through the
same path as vLLM (shared memory or tcp) into a byte-counting sink.

Faults for the fencing tests (tests/integration/test_fencing.py), all off by
default: ``sleep_delay_s`` makes every sleep after the first (the worker's own
start-up sleep) take that long (a hang, as seen by a coordinator with a shorter
command timeout); ``sleep_failures`` makes the first N of those sleeps raise;
``ignore_abort`` keeps requests running through every abort (only cancelling
their stream ends them); ``ignore_pause`` lets requests decode through a pause (a
request finishing as the shard drains); ``stuck`` requests are counted as running and can
never be stopped. ``running_at_sleep`` records how many ran at each sleep.
``built_marker``: a file created when the engine is built (to see when it is).
``load_error``: ``"refused"`` makes the next weight update fail before any
weight changes (a SyncError), ``"midway"`` after it began (any other error).
``load_delay_s``: each weight update takes at least that long. ``wake_failures``:
the first N wakes raise (as vLLM's ``wake_up`` does when its executor fails), leaving
the engine asleep.

Adapters (a base group's shard, AdapterEngine): ``load_adapter`` pulls the
member's version through the same real path into a counting sink, after
``adapter_delay_s``; a request with ``adapter`` reports that adapter's version at
its start and offsets its tokens by the adapter name (``adapter_offset``), so a
test sees whose adapter served it. ``served`` records (adapter, request id) per
request started; ``pauses`` counts pause calls. ``adapter_error`` makes the next
adapter load fail.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

import torch

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.engine import GenerationChunk
from rlix_async.protocols.generation import Sampling
from rlix_async.weights.transports import pull

SLEEP_TAGS = frozenset(("weights", "kv_cache"))  # vllm/v1/executor/abstract.py


class _CountingSink:
    def __init__(self) -> None:
        self.bytes = 0

    def start(self, version: int, layout: Layout) -> None:
        self.bytes = 0

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.bytes += sum(t.numel() * t.element_size() for _, t in named)

    def finish(self, version: int) -> None:
        pass

    def abort(self) -> None:
        pass


@dataclass(frozen=True)
class Transition:
    """One sleep/wake/pause/resume/load as the engine saw it, and what it held after."""

    op: str  # "sleep(2)", "wake_up(['weights'])", "pause(keep)", "resume", "load(3)"
    sleeping: frozenset[str]
    scheduler_paused: bool
    device_bytes: int
    host_bytes: int
    note: str = ""  # vLLM's warning when the call was a no-op


class EngineCrashed(RuntimeError):
    """What vLLM's engine dies of on CUDA when used with its memory unmapped."""


@dataclass
class ScriptedEngine:
    token_delay_s: float = 0.01
    vocab: int = 1000
    weight_version: int | None = None
    sleep_delay_s: float = 0.0
    sleep_failures: int = 0
    wake_failures: int = 0
    ignore_abort: bool = False
    ignore_pause: bool = False
    stuck: int = 0
    load_error: str = ""
    load_delay_s: float = 0.0
    built_marker: str = ""
    weights_bytes: int = 64 << 20
    kv_bytes: int = 256 << 20
    sleeps: int = 0
    running_at_sleep: list[int] = field(default_factory=list)
    sleeping: set[str] = field(default_factory=set)  # vLLM's executor.sleeping_tags
    scheduler_paused: bool = False  # vLLM's scheduler pause state (any mode)
    host_backup: bool = False  # weights offloaded to host memory by a level-1 sleep
    transitions: list[Transition] = field(default_factory=list)
    loaded_bytes: int = 0
    adapter_versions: dict[str, int] = field(default_factory=dict)
    adapter_bytes: dict[str, int] = field(default_factory=dict)
    adapter_delay_s: float = 0.0
    adapter_error: bool = False
    served: list[tuple[str | None, str]] = field(default_factory=list)
    pauses: int = 0
    _adapter_layouts: dict[str, Layout] = field(default_factory=dict)
    _running: dict[int, asyncio.Event] = field(default_factory=dict)
    _keys: Iterator[int] = field(default_factory=itertools.count)
    _layout: Layout | None = None

    def __post_init__(self) -> None:
        if self.built_marker:
            with open(self.built_marker, "w") as fh:
                fh.write("built\n")

    @property
    def asleep(self) -> bool:
        return bool(self.sleeping)

    @property
    def device_bytes(self) -> int:
        return (self.weights_bytes if "weights" not in self.sleeping else 0) + (
            self.kv_bytes if "kv_cache" not in self.sleeping else 0
        )

    def _record(self, op: str, note: str = "") -> None:
        self.transitions.append(
            Transition(
                op,
                frozenset(self.sleeping),
                self.scheduler_paused,
                self.device_bytes,
                self.weights_bytes if self.host_backup else 0,
                note,
            )
        )

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        max_tokens, stop_token_ids = sampling.max_tokens, sampling.stop_token_ids
        key = next(self._keys)
        cancelled = self._running[key] = asyncio.Event()
        self.served.append((adapter, request_id or ""))
        version = self.weight_version if adapter is None else self.adapter_versions[adapter]
        base = sum(prompt_ids) + adapter_offset(adapter)
        tokens: list[int] = []
        try:
            for i in range(max_tokens):
                while self.scheduler_paused and not self.ignore_pause and not cancelled.is_set():  # noqa: ASYNC110
                    await asyncio.sleep(0.001)  # an abort must end a paused request too
                if cancelled.is_set():
                    yield GenerationChunk(tokens, [0.0] * len(tokens), True, version)
                    return
                if self.sleeping and not self.scheduler_paused:
                    raise EngineCrashed(
                        f"decoding with {sorted(self.sleeping)} asleep (the scheduler was "
                        "resumed under a sleeping tag)"
                    )
                await asyncio.sleep(self.token_delay_s)
                tokens.append((base + i) % self.vocab)
                # as vLLM reports it: "stop" at a stop token, "length" at max_tokens
                reason = (
                    "stop"
                    if tokens[-1] in (stop_token_ids or ())
                    else "length"
                    if i == max_tokens - 1
                    else None
                )
                yield GenerationChunk(
                    list(tokens), [0.0] * len(tokens), reason is not None, version, reason
                )
                if reason == "stop":
                    return
        finally:
            self._running.pop(key, None)

    async def abort_all(self) -> int:
        if not self.ignore_abort:
            for ev in self._running.values():
                ev.set()
        return len(self._running)

    def num_running(self) -> int:
        return len(self._running) + self.stuck

    def _pause_scheduler(self, mode: str) -> None:
        # EngineCore.pause_scheduler: abort ends every request; both modes pause
        if mode == "abort" and not self.ignore_abort:
            for ev in self._running.values():
                ev.set()
        self.scheduler_paused = True

    async def pause(self, mode: str = "abort") -> None:
        self.pauses += 1
        self._pause_scheduler(mode)
        self._record(f"pause({mode})")

    async def resume(self) -> None:
        self.scheduler_paused = False  # resume_scheduler: whatever sleeps
        self._record("resume")

    async def sleep(self, level: int = 2, mode: str = "abort") -> None:
        self.running_at_sleep.append(self.num_running())
        self.sleeps += 1
        if self.sleeps > 1:  # the first is the worker's start-up sleep
            await asyncio.sleep(self.sleep_delay_s)
            if self.sleep_failures:
                self.sleep_failures -= 1
                raise RuntimeError("scripted sleep failure")
        self._pause_scheduler(mode)
        if "weights" in self.sleeping:  # Executor.sleep returns early
            self._record(f"sleep({level})", "Executor is already sleeping.")
            return
        # CuMemAllocator.sleep: what is awake goes (a KV cache already asleep is skipped)
        self.host_backup = level == 1
        if level >= 2:
            self.weight_version = None  # discarded: the contents are gone
        self.sleeping |= SLEEP_TAGS
        self._record(f"sleep({level})")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.wake_failures:
            self.wake_failures -= 1
            self._record(f"wake_up({tags})", "scripted failure")
            raise RuntimeError("Call to wake_up method failed: scripted failure")
        note = ""
        if not self.sleeping:
            note = "Executor is not sleeping."
        elif tags and any(tag not in self.sleeping for tag in tags):
            note = f"Tag {tags} is not in sleeping tags {sorted(self.sleeping)}"
        else:
            woken = set(tags) if tags else set(self.sleeping)
            if "weights" in woken:
                self.host_backup = False  # restored from host memory, or left undefined
            self.sleeping -= woken
        if not self.sleeping:  # EngineCore.wake_up: fully awake resumes scheduling
            self.scheduler_paused = False
        self._record(f"wake_up({tags})", note)

    async def load_version(self, ref: CacheRef) -> None:
        if "weights" in self.sleeping:
            raise EngineCrashed(f"version {ref.version}: loading weights while they sleep")
        error, self.load_error = self.load_error, ""
        if error == "refused":
            from rlix_async.protocols.sinks import SyncError

            raise SyncError(f"version {ref.version}: scripted refusal")
        if error == "midway":
            self.weight_version = None  # half loaded: the contents are unknown
            raise RuntimeError(f"version {ref.version}: scripted failure mid-load")
        await asyncio.sleep(self.load_delay_s)
        sink = _CountingSink()
        self._layout = await pull(ref, sink, self._layout)
        self.loaded_bytes = sink.bytes
        self.weight_version = ref.version
        self._record(f"load({ref.version})")

    async def load_adapter(self, name: str, ref: CacheRef) -> None:
        await asyncio.sleep(self.adapter_delay_s)
        if self.adapter_error:
            self.adapter_error = False
            raise RuntimeError(f"adapter {name} version {ref.version}: scripted failure")
        sink = _CountingSink()
        self._adapter_layouts[name] = await pull(ref, sink, self._adapter_layouts.get(name))
        self.adapter_bytes[name] = sink.bytes
        self.adapter_versions[name] = ref.version


def adapter_offset(adapter: str | None) -> int:
    """How a request's tokens show whose adapter served it (0: the base)."""
    return sum(map(ord, adapter)) if adapter else 0
