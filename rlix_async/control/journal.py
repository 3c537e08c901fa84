"""The scheduling journal: typed events, appended as JSON lines, replayed after a restart.

Every line is one :data:`Event`, tagged by ``ev`` (``{"ev": "grant", "t": ...,
"pipeline": ...}``). The coordinator writes them, the simulator writes the
same events on simulated time, ``rlix-async timeline`` draws them and a
restarted coordinator replays them into its registry (``Event.apply``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

import msgspec

from rlix_async.control.registry import Registry
from rlix_async.control.topology import ClusterName, ClusterSpec, Priority, PriorityName

log = logging.getLogger(__name__)


class JournalEvent(msgspec.Struct, tag_field="ev", kw_only=True):
    pipeline: str
    t: float = 0.0  # unix time (coordinator) or simulated seconds (simulator); set on record

    def apply(self, registry: Registry) -> None:
        """Replay into a registry: nothing, unless the event changes what it holds."""


class Registered(JournalEvent, tag="register"):
    clusters: dict[ClusterName, ClusterSpec]

    def apply(self, registry: Registry) -> None:
        registry.register(self.pipeline, dict(self.clusters))


class Admitted(JournalEvent, tag="admit"):
    def apply(self, registry: Registry) -> None:
        registry.admit(self.pipeline)


class Unregistered(JournalEvent, tag="unregister"):
    reason: str = ""

    def apply(self, registry: Registry) -> None:
        registry.remove(self.pipeline)


class Requested(JournalEvent, tag="request"):
    """Not replayed: a reconnecting driver re-sends its queued requests (Resume)."""

    cluster: ClusterName
    priority: PriorityName
    seq: int


class Granted(JournalEvent, tag="grant"):
    cluster: ClusterName
    priority: PriorityName
    devices: list[int]

    def apply(self, registry: Registry) -> None:
        registry.pipelines[self.pipeline].held[self.cluster] = Priority[self.priority]


class Released(JournalEvent, tag="release"):
    cluster: ClusterName

    def apply(self, registry: Registry) -> None:
        registry.pipelines[self.pipeline].held.pop(self.cluster, None)


class Expanded(JournalEvent, tag="expand"):
    cluster: ClusterName
    ranks: list[int]
    devices: list[int]

    def apply(self, registry: Registry) -> None:
        registry.pipelines[self.pipeline].active.update(self.ranks)


class Shrunk(JournalEvent, tag="shrink"):
    cluster: ClusterName
    ranks: list[int]
    devices: list[int]

    def apply(self, registry: Registry) -> None:
        registry.pipelines[self.pipeline].active.difference_update(self.ranks)


class Fenced(JournalEvent, tag="fence"):
    """A rank's devices fenced: its worker may still hold them (replayed even after its
    pipeline is gone: the worker process is not)."""

    rank: int
    devices: list[int]
    holder: str | None
    reason: str

    def apply(self, registry: Registry) -> None:
        registry.fence(
            self.pipeline, self.rank, tuple(self.devices), self.reason, holder=self.holder
        )


class Unfenced(JournalEvent, tag="unfence"):
    rank: int
    reason: str = ""

    def apply(self, registry: Registry) -> None:
        registry.fences.pop((self.pipeline, self.rank), None)


class ShardJoined(JournalEvent, tag="shard_joined"):
    """A shard worker process said hello: after a restart, its rank is known to have had
    a worker (whose fence only its own sleep or a replacement lifts)."""

    rank: int
    incarnation: str

    def apply(self, registry: Registry) -> None:
        registry.workers[(self.pipeline, self.rank)] = self.incarnation


class ProgressReported(JournalEvent, tag="progress"):
    stream: str
    target: int
    completed: int

    def apply(self, registry: Registry) -> None:
        registry.report_progress(self.pipeline, self.stream, self.target, self.completed)


class ProgressCleared(JournalEvent, tag="clear_progress"):
    stream: str | None = None

    def apply(self, registry: Registry) -> None:
        registry.clear_progress(self.pipeline, self.stream)


class WeightsPublished(JournalEvent, tag="weights"):
    version: int


class ShardSynced(JournalEvent, tag="synced"):
    rank: int
    version: int | None


Event = (
    Registered
    | Admitted
    | Unregistered
    | Requested
    | Granted
    | Released
    | Expanded
    | Shrunk
    | ProgressReported
    | ProgressCleared
    | WeightsPublished
    | ShardSynced
    | Fenced
    | Unfenced
    | ShardJoined
)
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Event)


class Journal:
    """Appends events to a JSONL file (nothing when ``path`` is None), one write each."""

    def __init__(self, path: str | Path | None, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path) if path else None
        self.clock = clock
        self._fh: BinaryIO | None = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = self.path.open("ab", buffering=0)  # each event reaches the OS at once

    def record(self, event: Event) -> None:
        event.t = round(self.clock(), 6)
        if self._fh is not None:
            self._fh.write(_encoder.encode(event) + b"\n")

    def sync(self) -> None:
        if self._fh is not None:
            os.fsync(self._fh.fileno())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def write_journal(path: str | Path, events: Iterable[Event]) -> None:
    with open(path, "wb") as fh:
        for ev in events:
            fh.write(_encoder.encode(ev) + b"\n")


def read_journal(path: str | Path) -> Iterator[Event]:
    """Events in order; a line that is not a known event (a torn last line after a
    crash mid-write, an event from a newer version) is skipped with a warning."""
    with Path(path).open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield _decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("%s:%d: unreadable journal line skipped (%s)", path, lineno, exc)


def replay(path: str | Path, registry: Registry) -> int:
    """Rebuild registrations, held stages, awake ranks and progress. Returns events read.

    Queued requests are not replayed: their drivers re-send them when they
    reconnect (the client library's Resume), which is the authoritative copy.
    """
    if not Path(path).exists():
        return 0
    n = 0
    for n, ev in enumerate(read_journal(path), 1):
        fence_event = isinstance(ev, Fenced | Unfenced | ShardJoined)
        if (
            not (isinstance(ev, Registered) or fence_event)
            and ev.pipeline not in registry.pipelines
        ):
            continue
        try:
            ev.apply(registry)
        except (KeyError, ValueError, TypeError) as exc:
            log.warning("journal event %d (%s) not replayed: %s", n, type(ev).__name__, exc)
    return n
