"""The scheduling journal's events: what each records and how it applies on replay.

Every event is a tagged msgspec struct (``{"ev": "grant", "t": ..., "pipeline": ...}``);
:mod:`rlix_async.control.journal` writes, reads and replays them. An event applies
only to a registry it still fits (:class:`InapplicableEvent` otherwise), so a replay
never builds a state the coordinator could not have had (docs/JOURNAL.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import msgspec

from rlix_async.control.fences import Fence
from rlix_async.control.registry import PipelineState, Registry
from rlix_async.protocols.snapshot import ProgressIn
from rlix_async.protocols.topology import (
    INFER,
    ClusterName,
    ClusterSpec,
    Priority,
    PriorityName,
    priority_name,
)

log = logging.getLogger(__name__)


class InapplicableEvent(ValueError):
    """An event that no longer applies to the registry it is replayed into (its pipeline
    is unknown, its devices are another pipeline's, its cluster is not declared)."""


# --- the events ---------------------------------------------------------------------------


class JournalEvent(msgspec.Struct, tag_field="ev", kw_only=True):
    pipeline: str
    t: float = 0.0  # unix time (coordinator) or simulated seconds (simulator); set on record

    def apply(self, registry: Registry) -> None:
        """Replay into a registry: nothing, unless the event changes what it holds.
        An event that raises changed nothing (every check comes before the change)."""


class Registered(JournalEvent, tag="register"):
    clusters: dict[ClusterName, ClusterSpec]
    weight: float = 1.0
    group: str | None = None  # a LoRA pipeline's base group

    def apply(self, registry: Registry) -> None:
        registry.register(self.pipeline, dict(self.clusters), self.weight, self.group)


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
        _hold(registry, self.pipeline, self.cluster, self.priority)


class Released(JournalEvent, tag="release"):
    cluster: ClusterName

    def apply(self, registry: Registry) -> None:
        _known(registry, self.pipeline).held.pop(self.cluster, None)


class Expanded(JournalEvent, tag="expand"):
    cluster: ClusterName
    ranks: list[int]
    devices: list[int]

    def apply(self, registry: Registry) -> None:
        _wake(registry, self.pipeline, self.cluster, self.ranks)


class Shrunk(JournalEvent, tag="shrink"):
    cluster: ClusterName
    ranks: list[int]
    devices: list[int]

    def apply(self, registry: Registry) -> None:
        _known(registry, self.pipeline).active.difference_update(self.ranks)


class Fenced(JournalEvent, tag="fence"):
    """A rank's devices fenced: its worker may still hold them (replayed even after its
    pipeline is gone: the worker process is not)."""

    rank: int
    devices: list[int]
    holder: str | None
    reason: str

    def apply(self, registry: Registry) -> None:
        _check_devices(registry, self.devices)
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
    adapter: str | None = None  # a base group's shard: the member whose adapter it holds


class ProgressRecord(msgspec.Struct, kw_only=True):
    stream: str
    target: int
    completed: int


class PipelineRecord(msgspec.Struct, kw_only=True):
    """A registered pipeline as a snapshot keeps it: what its events' replay rebuilds."""

    id: str
    clusters: dict[ClusterName, ClusterSpec]
    admitted: bool = False
    held: dict[ClusterName, PriorityName] = {}
    active: list[int] = []
    progress: list[ProgressRecord] = []
    weight: float = 1.0
    group: str | None = None  # a member: its base group (made by its registration)
    base: bool = False  # a base group itself: only its awake ranks are restored


class FenceRecord(msgspec.Struct, kw_only=True):
    pipeline: str
    rank: int
    devices: list[int]
    holder: str | None
    reason: str


class WorkerRecord(msgspec.Struct, kw_only=True):
    pipeline: str
    rank: int
    incarnation: str


class RegistrySnapshot(JournalEvent, tag="snapshot"):
    """The registry's durable state, written by compaction in place of the history that
    built it: replaying it and then later events gives what replaying the whole history
    gives. It replaces whatever the registry held. Not one pipeline's event, so its
    ``pipeline`` is empty; readers that draw or count events ignore it."""

    pipeline: str = ""
    pipelines: list[PipelineRecord] = []
    fences: list[FenceRecord] = []
    workers: list[WorkerRecord] = []

    @classmethod
    def of(cls, registry: Registry) -> RegistrySnapshot:
        return cls(
            pipelines=[
                PipelineRecord(
                    id=p.id,
                    clusters=dict(p.clusters),
                    admitted=p.admitted,
                    weight=p.weight,
                    group=p.group,
                    base=bool(p.members),
                    held={c: priority_name(pr) for c, pr in p.held.items()},
                    active=sorted(p.active),
                    progress=[
                        ProgressRecord(stream=s, target=pr.target, completed=pr.completed)
                        for s, pr in p.progress.items()
                    ],
                )
                for p in registry.pipelines.values()
                if p.registered  # an id allocated but never registered is not journaled
            ],
            fences=[
                FenceRecord(
                    pipeline=f.pipeline,
                    rank=f.rank,
                    devices=list(f.devices),
                    holder=f.holder,
                    reason=f.reason,
                )
                for f in registry.fences.values()
            ],
            workers=[
                WorkerRecord(pipeline=pid, rank=rank, incarnation=inc)
                for (pid, rank), inc in registry.workers.items()
            ],
        )

    def apply(self, registry: Registry) -> None:
        """Restore part by part with the events' own checks (the registry may have
        another shape than the one that wrote it): a part that no longer applies is
        reported and left out, the rest is restored."""
        registry.pipelines.clear()
        registry.fences.clear()
        registry.workers.clear()
        left_out: list[str] = []
        for w in self.workers:
            registry.workers[(w.pipeline, w.rank)] = w.incarnation
        # members first: their registration makes their base groups
        for rec in sorted(self.pipelines, key=lambda r: r.base):
            try:
                if rec.base:
                    p = _known(registry, rec.id)
                else:
                    p = registry.register(rec.id, dict(rec.clusters), rec.weight, rec.group)
            except Exception as exc:
                left_out.append(f"pipeline {rec.id}: {exc}")
                continue
            p.admitted = rec.admitted
            for cluster, prio in rec.held.items():
                try:
                    _hold(registry, rec.id, cluster, prio)
                except Exception as exc:
                    left_out.append(f"{rec.id}/{cluster}: {exc}")
            for rank in rec.active:
                try:
                    _wake(registry, rec.id, INFER, [rank])
                except Exception as exc:
                    left_out.append(f"{rec.id}/{INFER}[{rank}]: {exc}")
            for pr in rec.progress:
                p.progress[pr.stream] = ProgressIn(
                    target=pr.target, completed=pr.completed, stream=pr.stream
                )
        for f in self.fences:
            try:
                _check_devices(registry, f.devices)
            except InapplicableEvent as exc:
                left_out.append(f"fence {f.pipeline}/{INFER}[{f.rank}]: {exc}")
                continue
            # the holder as it was, not the registry's fallback to the rank's last worker
            registry.fences[(f.pipeline, f.rank)] = Fence(
                f.pipeline, f.rank, tuple(f.devices), f.holder, f.reason, time.monotonic()
            )
        if left_out:
            log.warning(
                "journal snapshot: %d parts left out: %s", len(left_out), "; ".join(left_out)
            )


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
    | RegistrySnapshot
)
# What a power loss must not take once the coordinator acted on it: every event
# replay rebuilds state from, except progress (frequent, advisory, re-reported) and
# Unfenced. Losing an Unfenced is safe: replay keeps the fence and the restarted
# coordinator asks the rank to sleep again (a rank whose worker is gone for good
# stays fenced, so the window is kept short: lifted fences are fsynced together
# 50 ms after the first, realise.UNFENCE_SYNC_S). Not fsyncing each one matters:
# every confirmed sleep writes one, thousands a minute at 4,096 devices, each a
# 0.2-1.2 ms stall of the coordinator's loop.
LEASE_EVENTS = (
    Registered,
    Admitted,
    Unregistered,
    Granted,
    Released,
    Expanded,
    Shrunk,
    Fenced,
    ShardJoined,
    RegistrySnapshot,
)


# --- replay checks: an event applies only to a registry it still fits ----------------------


def _known(registry: Registry, pid: str) -> PipelineState:
    p = registry.pipelines.get(pid)
    if p is None or not p.registered:
        raise InapplicableEvent(f"pipeline {pid} is not registered")
    return p


def _check_devices(registry: Registry, devices: Iterable[int]) -> None:
    n = registry.shape.num_devices
    missing = [d for d in devices if not 0 <= d < n]
    if missing:
        raise InapplicableEvent(f"devices {missing} do not exist (the cluster has {n})")


def _check_free(registry: Registry, pid: str, devices: Iterable[int]) -> None:
    """Another pipeline holding any of the devices means an event was lost before this
    one (the coordinator journals a release or shrink before the grant that follows)."""
    wanted = set(devices)
    owners: list[str] = []
    for q in registry.pipelines.values():  # (loops, not comprehensions: replay's hot path)
        if q.id == pid:
            continue
        for c in q.held:
            if not wanted.isdisjoint(q.clusters[c].devices):
                owners.append(f"{q.id}/{c}")
        if q.active:
            spec = q.clusters[INFER]  # (a rank is woken only on a declared INFER cluster)
            for r in q.active:
                if not wanted.isdisjoint(spec.bundle(r)):
                    owners.append(f"{q.id}/{INFER}[{r}]")
    if owners:
        raise InapplicableEvent(f"devices {sorted(wanted)} are held by {owners}")


def _hold(registry: Registry, pid: str, cluster: ClusterName, priority: str) -> None:
    p = _known(registry, pid)
    spec = p.clusters.get(cluster)
    if spec is None:
        raise InapplicableEvent(f"pipeline {pid} declared no {cluster} cluster")
    prio = Priority[priority]
    _check_free(registry, pid, spec.devices)
    p.held[cluster] = prio


def _wake(registry: Registry, pid: str, cluster: ClusterName, ranks: Iterable[int]) -> None:
    p = _known(registry, pid)
    spec = p.clusters.get(INFER)
    if cluster != INFER or spec is None:
        raise InapplicableEvent(f"pipeline {pid}: ranks are woken on {INFER}, not {cluster}")
    ranks = list(ranks)
    bad = [r for r in ranks if not 0 <= r < spec.dp]
    if bad:
        raise InapplicableEvent(f"pipeline {pid}: {INFER} has no ranks {bad} (dp={spec.dp})")
    _check_free(registry, pid, [d for r in ranks for d in spec.bundle(r)])
    p.active.update(ranks)
