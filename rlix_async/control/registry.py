"""The coordinator's state: who is registered, who holds what, who waits for what,
and which devices are fenced.

No I/O here. The coordinator mutates it from its handlers, builds the planner's
snapshot from it, and records the logical effect of a plan with
:meth:`Registry.apply` before the commands that realise it are sent.

Fences (docs/SCHEDULING.md, "Fenced leases"): a rollout rank that leaves the
plan (shrunk, given up, its worker lost, its pipeline dropped) fences its
devices until the worker process that may still hold them has confirmed its
sleep, or is known dead because a new worker process for that rank said hello
(a supervisor starts a replacement only after reaping the old one). A fenced
device is never planned for anyone, and a grant or wake on it is delivered
only once no fence covers it (``registry.fences.covering``, control/fences.py).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from rlix_async.control.fences import Fence, FenceTable
from rlix_async.control.pace import PaceBook
from rlix_async.protocol import RpcError
from rlix_async.protocols.messages import DeviceOwner
from rlix_async.protocols.snapshot import (
    PipelineIn,
    Plan,
    Policy,
    ProgressIn,
    RequestIn,
    Snapshot,
)
from rlix_async.protocols.topology import (
    INFER,
    TRAIN,
    ClusterName,
    ClusterShape,
    ClusterSpec,
    Priority,
    TopologyError,
    priority_name,
    validate_topology,
)


class RegistryError(RpcError):
    """A request the coordinator refuses; the code says why."""


@dataclass
class Pending:
    seq: int
    cluster: ClusterName
    priority: Priority
    estimate: int | None
    since: float


@dataclass
class PipelineState:
    id: str
    clusters: dict[ClusterName, ClusterSpec] = field(default_factory=dict)
    admitted: bool = False
    held: dict[ClusterName, Priority] = field(default_factory=dict)
    # which grant of a held stage this is: a new number for every grant, so a stage
    # released and granted again is a new hold (the lease loop times each, max_hold)
    grant_ids: dict[ClusterName, int] = field(default_factory=dict)
    active: set[int] = field(default_factory=set)
    progress: dict[str, ProgressIn] = field(default_factory=dict)
    requests: dict[ClusterName, Pending] = field(default_factory=dict)
    connected: bool = True
    lost_at: float | None = None  # when its driver went silent (lease timer start)
    offline: set[int] = field(default_factory=set)  # infer ranks whose shard worker died
    weight: float = 1.0  # fair-share weight among pipelines of the same priority
    # A LoRA pipeline: the base group whose shards serve its rollouts (it keeps its
    # actor_infer declaration, the group's; its own rank sets stay empty).
    group: str | None = None
    # A base group (docs/SCHEDULING.md, "Base groups"): its members, in the order they
    # registered. It declares only actor_infer and owns the shards, ranks and fences.
    members: list[str] = field(default_factory=list)

    @property
    def registered(self) -> bool:
        return bool(self.clusters)

    def remaining(self) -> int | None:
        if not self.progress:
            return None
        return sum(p.target - min(p.completed, p.target) for p in self.progress.values())


class Registry:
    def __init__(self, shape: ClusterShape, policy: Policy | None = None) -> None:
        self.shape = shape
        self.policy = policy or Policy()
        self.pipelines: dict[str, PipelineState] = {}
        self.fences = FenceTable()
        self.pace = PaceBook()  # what finish-time fairness reads (control/pace.py)
        # The last worker incarnation seen per rollout rank ("host:pid"); kept after it
        # is lost, so a rank whose worker vanished is told apart from one never run.
        self.workers: dict[tuple[str, int], str] = {}
        self._ids = itertools.count(0)
        self._seq = itertools.count(1)
        self._grant_ids = itertools.count(1)

    # --- lifecycle ----------------------------------------------------------------------

    def allocate_id(self, kind: str) -> str:
        """A fresh id: never one a live pipeline, a fence or a known worker still uses
        (after a restart the counter starts again; a dropped pipeline's workers live on)."""
        taken = {pid for pid, _ in self.fences} | {pid for pid, _ in self.workers}
        while True:
            pid = f"{kind}-{next(self._ids)}"
            if pid not in self.pipelines and pid not in taken:
                self.pipelines[pid] = PipelineState(pid)
                return pid

    def get(self, pid: str) -> PipelineState:
        p = self.pipelines.get(pid)
        if p is None:
            raise RegistryError("unknown_pipeline", f"pipeline {pid!r} is not known here")
        return p

    def register(
        self,
        pid: str,
        clusters: dict[ClusterName, ClusterSpec],
        weight: float = 1.0,
        group: str | None = None,
    ) -> PipelineState:
        """Register (or re-register) a pipeline. With ``group``, a LoRA pipeline joins
        that base group, created by its first member: the group owns actor_infer, which
        every member must declare alike."""
        try:
            validate_topology(clusters, self.shape)
        except TopologyError as exc:
            raise RegistryError("bad_topology", f"pipeline {pid}: {exc}") from None
        existing = self.pipelines.get(pid)
        if existing is not None and existing.members:
            raise RegistryError("bad_group", f"{pid} is the id of a base group")
        if existing is not None and existing.registered and existing.group != group:
            raise RegistryError(
                "already_registered", f"pipeline {pid} is registered in another base group"
            )
        if existing is not None and existing.registered and existing.clusters != clusters:
            raise RegistryError(
                "already_registered", f"pipeline {pid} is registered with another topology"
            )
        # every check is above or in _group_for, before anything changes: a refused
        # registration (or Resume) leaves no half-made group behind
        base = self._group_for(pid, clusters, group) if group is not None else None
        p = self.pipelines.setdefault(pid, PipelineState(pid))
        p.clusters = dict(clusters)
        p.weight = weight  # a restarted driver may bring a new one
        if base is not None:
            p.group = base.id
            if pid not in base.members:
                base.members.append(pid)
        return p

    def _group_for(
        self, pid: str, clusters: dict[ClusterName, ClusterSpec], group: str
    ) -> PipelineState:
        """The base group ``pid`` may join (created here by its first member)."""
        if group == pid:
            raise RegistryError("bad_group", f"pipeline {pid} cannot be its own base group")
        base = self.pipelines.get(group)
        if base is None:
            base = self.pipelines[group] = PipelineState(
                group, clusters={INFER: clusters[INFER]}, admitted=True
            )
        elif not base.members and base.registered:
            raise RegistryError("bad_group", f"base group {group} is the id of a pipeline")
        elif base.clusters.get(INFER) != clusters[INFER]:
            first = base.members[0] if base.members else "its first member"
            raise RegistryError(
                "bad_group",
                f"pipeline {pid}: {INFER} differs from base group {group}'s (declared by "
                f"{first}): its members share the same shards",
            )
        return base

    def admit(self, pid: str, now: float | None = None) -> None:
        p = self.get(pid)
        if not p.registered:
            raise RegistryError("not_registered", f"pipeline {pid}: register before admit")
        self.pace.started(pid, time.monotonic() if now is None else now)
        p.admitted = True

    def remove(self, pid: str, *, fence: bool = False) -> PipelineState | None:
        """Forget a pipeline; with ``fence``, its awake ranks' devices stay fenced. A base
        group goes with its last member, and its awake ranks likewise."""
        p = self.pipelines.pop(pid, None)
        self.pace.forget(pid)
        dropped = [p] if p is not None else []
        if p is not None and p.group is not None:
            base = self.pipelines[p.group]
            base.members.remove(pid)
            if not base.members:
                dropped.append(self.pipelines.pop(base.id))
        for q in dropped:
            if fence and INFER in q.clusters:
                for r in q.active:
                    reason = "sleeping (pipeline dropped)"
                    self.fence(q.id, r, q.clusters[INFER].bundle(r), reason)
        return p

    # --- fences -----------------------------------------------------------------------------

    def fence(
        self,
        pid: str,
        rank: int,
        devices: tuple[int, ...],
        reason: str,
        now: float | None = None,
        holder: str | None = None,
    ) -> Fence:
        """Fence a rank's devices (or update why); the holder is its last known worker."""
        key = (pid, rank)
        old = self.fences.get(key)
        if old is not None:
            old.reason = reason
            return old
        f = Fence(
            pid,
            rank,
            tuple(devices),
            holder or self.workers.get(key),
            reason,
            time.monotonic() if now is None else now,
        )
        self.fences[key] = f
        return f

    def confirm_asleep(self, pid: str, rank: int, incarnation: str | None) -> Fence | None:
        """The worker ``incarnation`` confirmed its sleep: lift the fence it was holding.
        ``None`` means no worker ever ran this rank (nothing can hold the devices)."""
        f = self.fences.get((pid, rank))
        if f is None:
            return None
        if incarnation is None and self.workers.get((pid, rank)) is not None:
            return None  # a worker did run it: only that worker (or its death) can tell
        if f.holder is not None and incarnation is not None and f.holder != incarnation:
            return None  # another process confirmed; the holder may still hold them
        return self.fences.pop((pid, rank))

    def worker_joined(self, pid: str, rank: int, incarnation: str) -> Fence | None:
        """A worker said hello. A new incarnation proves the old one is gone (reaped by
        its supervisor before a replacement starts): its fence is lifted and returned."""
        key = (pid, rank)
        self.workers[key] = incarnation
        f = self.fences.get(key)
        if f is not None and f.holder is not None and f.holder != incarnation:
            return self.fences.pop(key)
        if f is not None and f.holder is None:
            f.holder = incarnation  # fenced before any hello: this one may hold them now
        return None

    # --- stages --------------------------------------------------------------------------

    def request(
        self,
        pid: str,
        cluster: ClusterName,
        priority: Priority,
        estimate: int | None,
        now: float | None = None,
    ) -> Pending:
        p = self.get(pid)
        if not p.admitted:
            raise RegistryError("not_admitted", f"pipeline {pid}: admit before requesting")
        if cluster not in p.clusters:
            raise RegistryError("bad_request", f"pipeline {pid} declared no {cluster} cluster")
        if (priority == Priority.GENERATION) != (cluster == INFER) and (
            priority != Priority.INITIALIZATION
        ):
            raise RegistryError(
                "bad_request",
                f"GENERATION is requested on {INFER} and only there "
                f"(got {priority.name} on {cluster})",
            )
        if p.group is not None and cluster == INFER and priority != Priority.GENERATION:
            raise RegistryError(  # the group's shards are its; a member only asks rollouts
                "bad_request",
                f"pipeline {pid}: base group {p.group} holds {INFER}; a member asks "
                "GENERATION there, nothing else",
            )
        if cluster in p.held:
            raise RegistryError("bad_request", f"pipeline {pid} already holds {cluster}")
        existing = p.requests.get(cluster)
        if existing is not None:  # idempotent: a retried request keeps its place
            if existing.priority != priority:
                raise RegistryError(
                    "bad_request", f"{pid}/{cluster} already requested as {existing.priority.name}"
                )
            return existing
        req = Pending(
            next(self._seq), cluster, priority, estimate, time.monotonic() if now is None else now
        )
        p.requests[cluster] = req
        return req

    def release(self, pid: str, cluster: ClusterName, now: float | None = None) -> bool:
        """Drop a held stage or a queued request; False when there was neither. Training
        released ends a step (what the pace book times)."""
        p = self.get(pid)
        held = p.held.pop(cluster, None)
        if cluster == TRAIN and held == Priority.ACTOR_TRAINING:  # not a log-probs pass
            self.pace.step_ended(pid, time.monotonic() if now is None else now)
        return p.requests.pop(cluster, None) is not None or held is not None

    def report_progress(
        self, pid: str, stream: str, target: int, completed: int, now: float | None = None
    ) -> None:
        p = self.get(pid)
        p.progress[stream] = ProgressIn(target=target, completed=completed, stream=stream)
        self.pace.progressed(pid, *_progress_totals(p), time.monotonic() if now is None else now)

    def report_pace(self, pid: str, exclusive_step_s: float, now: float | None = None) -> None:
        """The pipeline's estimate of its step alone on every declared device."""
        self.get(pid)
        self.pace.reported(pid, exclusive_step_s, time.monotonic() if now is None else now)

    def clear_progress(self, pid: str, stream: str | None) -> None:
        p = self.get(pid)
        if stream is None:
            p.progress.clear()
        else:
            p.progress.pop(stream, None)
        self.pace.progress_cleared(pid, *_progress_totals(p))

    def training_delivered(self, pid: str, now: float | None = None) -> None:
        """Its grant of actor_train for ACTOR_TRAINING reached it (the executor sends
        it once no fence covers the devices; the simulator when the sleeps it waited
        for are done): its step's training starts now (control/pace.py)."""
        self.pace.training(pid, time.monotonic() if now is None else now)

    def restarted(self, pid: str, now: float | None = None) -> None:
        """A new driver process took ``pid`` over: its steps start over (the old one's
        downtime is no step of its own)."""
        self.pace.started(pid, time.monotonic() if now is None else now, again=True)

    # --- planning ----------------------------------------------------------------------------

    def snapshot(self, now: float | None = None) -> Snapshot:
        now = time.monotonic() if now is None else now
        pipes = []
        fair = self.policy.fairness == "finish_time"
        for p in self.pipelines.values():
            if not p.clusters:  # not registered
                continue
            # (each part built only where there is something: a snapshot per plan)
            held, active, offline = p.held, p.active, p.offline
            clusters, requests = p.clusters, p.requests
            progress: list[ProgressIn] | None = list(p.progress.values()) if p.progress else None
            weight = p.weight
            if p.group is not None:  # its rollouts are its group's: no actor_infer here
                clusters = {c: spec for c, spec in clusters.items() if c != INFER}
                requests = {c: r for c, r in requests.items() if c != INFER}
                progress = None
            elif p.members:
                progress, weight = self._group_demand(p)
            slowdown, stalled = None, 0.0
            if fair and (p.members or INFER in clusters):
                slowdown, stalled = self.pace_of(p, now)
            pipes.append(
                PipelineIn(
                    id=p.id,
                    clusters=clusters,
                    held={c: priority_name(pr) for c, pr in held.items()} if held else {},
                    active_ranks={INFER: sorted(active)} if active else {},
                    offline_ranks={INFER: sorted(offline)} if offline else {},
                    weight=weight,
                    progress=progress,
                    requests=[
                        RequestIn(
                            seq=r.seq,
                            cluster=r.cluster,
                            priority=priority_name(r.priority),
                            step_target_estimate=r.estimate,
                            age_s=max(0.0, now - r.since),
                        )
                        for r in requests.values()
                    ]
                    if requests and p.admitted
                    else [],
                    base_group=p.group,
                    slowdown=slowdown,
                    stalled_s=stalled,
                )
            )
        # Fenced devices nobody owns. One already held (a grant waiting for the fence
        # to lift before it is delivered) or awake (a wake waiting likewise) is owned.
        fenced: list[int] = []
        if self.fences:
            fenced = sorted(self.unowned(self.fences.devices()))
        return Snapshot(cluster=self.shape, pipelines=pipes, policy=self.policy, fenced=fenced)

    def pace_of(self, p: PipelineState, now: float) -> tuple[float | None, float]:
        """(slowdown, stalled_s) of a pipeline with rollouts, or of a base group: its
        worst-off member's slowdown, and the least any member's progress stood still
        (one member moving means the group's shards serve)."""
        if not p.members:
            wants = bool(p.remaining())
            return self.pace.slowdown(p.id, now), self.pace.stalled_s(p.id, now, wants)
        known = [s for m in p.members if (s := self.pace.slowdown(m, now)) is not None]
        wanting = [m for m in p.members if self.pipelines[m].remaining()]
        stalled = [self.pace.stalled_s(m, now, True) for m in wanting]  # (not a trainer's 0)
        return max(known, default=None), min(stalled, default=0.0)

    def _group_demand(self, base: PipelineState) -> tuple[list[ProgressIn] | None, float]:
        """A base group's rollout demand and weight. The demand is every member's
        progress streams (named ``member/stream``), or for a member that reported none,
        the estimate of its pending GENERATION request, as the planner reads a
        pipeline's own. The weight is the members' weights averaged by their demand, so
        the group's share (weight x demand) is the sum of what its members would ask
        alone; with no demand, their plain mean."""
        streams: list[ProgressIn] = []
        weighted = demand = 0.0
        for mid in base.members:
            m = self.pipelines[mid]
            own = [
                ProgressIn(target=s.target, completed=s.completed, stream=f"{mid}/{s.stream}")
                for s in m.progress.values()
            ]
            gen = m.requests.get(INFER)
            if not own and m.admitted and gen is not None and gen.estimate:
                own = [ProgressIn(target=gen.estimate, completed=0, stream=f"{mid}/asked")]
            left = sum(s.target - min(s.completed, s.target) for s in own)
            weighted += m.weight * left
            demand += left
            streams += own
        if demand:
            return streams, weighted / demand
        return streams or None, sum(self.pipelines[m].weight for m in base.members) / len(
            base.members
        )

    def apply(self, plan: Plan, *, fence: bool = False) -> list[str]:
        """Record the plan's outcome (the commands that realise it follow). With
        ``fence`` (the coordinator; the simulator models sleeps as durations), every
        shrunk rank's devices are fenced until its worker confirms the sleep.

        Returns the pipelines whose GENERATION request is now answered (they, or
        their base group, have at least one awake rank).
        """
        for ch in plan.shrink:
            p = self.pipelines[ch.pipeline]
            p.active.difference_update(ch.ranks)
            if fence:
                for r in ch.ranks:
                    self.fence(p.id, r, p.clusters[INFER].bundle(r), "sleeping")
        for g in plan.grants:
            p = self.pipelines[g.pipeline]
            p.held[g.cluster] = Priority[g.priority]
            p.grant_ids[g.cluster] = next(self._grant_ids)
            p.requests.pop(g.cluster, None)
        for ch in plan.expand:
            self.pipelines[ch.pipeline].active.update(ch.ranks)
        answered = []
        for p in self.pipelines.values():
            gen = p.requests.get(INFER)
            serving = p.active if p.group is None else self.pipelines[p.group].active
            if gen is not None and gen.priority == Priority.GENERATION and serving:
                del p.requests[INFER]
                answered.append(p.id)
        return answered

    def unowned(self, devices: set[int]) -> set[int]:
        """Those of ``devices`` no stage holds and no awake rank runs on (``owners()``
        None there). Cheap for a few devices: a snapshot asks it of the fenced ones on
        every plan, and a pipeline whose shards are nowhere near them is skipped."""
        left = set(devices)
        for p in self.pipelines.values():
            if not left:
                break
            for c in p.held:
                left.difference_update(p.clusters[c].devices)
            spec = p.clusters.get(INFER)
            if p.active and spec is not None and not left.isdisjoint(spec.devices):
                for r in p.active:
                    left.difference_update(spec.bundle(r))
        return left

    def owners(self) -> list[DeviceOwner | None]:
        """Per device: the stage or rollout shard holding it (None: idle)."""
        out: list[DeviceOwner | None] = [None] * self.shape.num_devices
        for p in self.pipelines.values():
            for c, pr in p.held.items():
                for d in p.clusters[c].devices:
                    out[d] = DeviceOwner(p.id, c, priority_name(pr))
            if INFER in p.clusters:
                spec = p.clusters[INFER]
                for r in p.active:
                    for d in spec.bundle(r):
                        out[d] = DeviceOwner(p.id, INFER, "GENERATION", r)
        return out


def _progress_totals(p: PipelineState) -> tuple[int, int]:
    """(target, completed) over every progress stream: what the pace book compares."""
    streams = p.progress.values()
    return sum(s.target for s in streams), sum(s.completed for s in streams)
