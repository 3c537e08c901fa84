"""The coordinator's state: who is registered, who holds what, who waits for what.

No I/O here. The coordinator mutates it from its handlers, builds the planner's
snapshot from it, and records the logical effect of a plan with
:meth:`Registry.apply` before the commands that realise it are sent.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from rlix_async.control.messages import DeviceOwner
from rlix_async.control.snapshot import (
    PipelineIn,
    Plan,
    Policy,
    ProgressIn,
    RequestIn,
    Snapshot,
)
from rlix_async.control.topology import (
    INFER,
    ClusterName,
    ClusterShape,
    ClusterSpec,
    Priority,
    TopologyError,
    priority_name,
    validate_topology,
)
from rlix_async.protocol import RpcError


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
    active: set[int] = field(default_factory=set)
    progress: dict[str, ProgressIn] = field(default_factory=dict)
    requests: dict[ClusterName, Pending] = field(default_factory=dict)
    connected: bool = True
    lost_at: float | None = None  # when its driver went silent (lease timer start)
    offline: set[int] = field(default_factory=set)  # infer ranks whose shard worker died

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
        self._ids = itertools.count(0)
        self._seq = itertools.count(1)

    # --- lifecycle ----------------------------------------------------------------------

    def allocate_id(self, kind: str) -> str:
        while True:
            pid = f"{kind}-{next(self._ids)}"
            if pid not in self.pipelines:
                self.pipelines[pid] = PipelineState(pid)
                return pid

    def get(self, pid: str) -> PipelineState:
        p = self.pipelines.get(pid)
        if p is None:
            raise RegistryError("unknown_pipeline", f"pipeline {pid!r} is not known here")
        return p

    def register(self, pid: str, clusters: dict[ClusterName, ClusterSpec]) -> PipelineState:
        try:
            validate_topology(clusters, self.shape)
        except TopologyError as exc:
            raise RegistryError("bad_topology", f"pipeline {pid}: {exc}") from None
        p = self.pipelines.setdefault(pid, PipelineState(pid))
        if p.registered and p.clusters != clusters:
            raise RegistryError(
                "already_registered", f"pipeline {pid} is registered with another topology"
            )
        p.clusters = dict(clusters)
        return p

    def admit(self, pid: str) -> None:
        p = self.get(pid)
        if not p.registered:
            raise RegistryError("not_registered", f"pipeline {pid}: register before admit")
        p.admitted = True

    def remove(self, pid: str) -> PipelineState | None:
        return self.pipelines.pop(pid, None)

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

    def release(self, pid: str, cluster: ClusterName) -> bool:
        """Drop a held stage or a queued request; False when there was neither."""
        p = self.get(pid)
        dropped = p.held.pop(cluster, None) is not None
        return p.requests.pop(cluster, None) is not None or dropped

    def report_progress(self, pid: str, stream: str, target: int, completed: int) -> None:
        self.get(pid).progress[stream] = ProgressIn(
            target=target, completed=completed, stream=stream
        )

    def clear_progress(self, pid: str, stream: str | None) -> None:
        p = self.get(pid)
        if stream is None:
            p.progress.clear()
        else:
            p.progress.pop(stream, None)

    # --- planning ----------------------------------------------------------------------------

    def snapshot(self, now: float | None = None) -> Snapshot:
        now = time.monotonic() if now is None else now
        pipes = []
        for p in self.pipelines.values():
            if not p.registered:
                continue
            pipes.append(
                PipelineIn(
                    id=p.id,
                    clusters=p.clusters,
                    held={c: priority_name(pr) for c, pr in p.held.items()},
                    active_ranks={INFER: sorted(p.active)} if p.active else {},
                    offline_ranks={INFER: sorted(p.offline)} if p.offline else {},
                    progress=list(p.progress.values()) or None,
                    requests=[
                        RequestIn(
                            seq=r.seq,
                            cluster=r.cluster,
                            priority=priority_name(r.priority),
                            step_target_estimate=r.estimate,
                            age_s=max(0.0, now - r.since),
                        )
                        for r in p.requests.values()
                        if p.admitted
                    ],
                )
            )
        return Snapshot(cluster=self.shape, pipelines=pipes, policy=self.policy)

    def apply(self, plan: Plan) -> list[str]:
        """Record the plan's outcome (the commands that realise it follow).

        Returns the pipelines whose GENERATION request is now answered (they
        have at least one awake rank).
        """
        for ch in plan.shrink:
            self.pipelines[ch.pipeline].active.difference_update(ch.ranks)
        for g in plan.grants:
            p = self.pipelines[g.pipeline]
            p.held[g.cluster] = Priority[g.priority]
            p.requests.pop(g.cluster, None)
        for ch in plan.expand:
            self.pipelines[ch.pipeline].active.update(ch.ranks)
        answered = []
        for p in self.pipelines.values():
            gen = p.requests.get(INFER)
            if gen is not None and gen.priority == Priority.GENERATION and p.active:
                del p.requests[INFER]
                answered.append(p.id)
        return answered

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
