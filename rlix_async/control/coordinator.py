"""The coordinator: one asyncio process that owns which device is held by whom.

Handlers mutate the :class:`Registry` and wake the scheduler loop. The loop
plans (pure planner), refuses any plan that breaks an invariant, records the
plan's outcome in the registry and the journal, then realises it in background
tasks (:mod:`rlix_async.control.realise`: shrinks first; a grant or an expand
waits only for the shrinks on its own devices; every command has a timeout).

Fault isolation: a driver that stops heartbeating keeps its leases for
``lease_timeout_s`` (it may be reconnecting), then loses them; nobody else is
affected. Restart: the journal rebuilds registrations, stages held and ranks
awake; reconnecting drivers re-assert their state with ``Resume``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from rlix_async.aio import Supervisor, until_signalled
from rlix_async.config import CoordinatorConfig, SchedulerConfig
from rlix_async.control import journal as ev
from rlix_async.control import messages as m
from rlix_async.control.journal import Journal, replay
from rlix_async.control.planner import check_plan, plan
from rlix_async.control.realise import PlanRealiser, devices_of
from rlix_async.control.registry import Registry, RegistryError
from rlix_async.control.snapshot import Plan, RankChange
from rlix_async.control.topology import (
    INFER,
    ClusterName,
    ClusterShape,
    Priority,
    priority_name,
)
from rlix_async.protocol import Ok
from rlix_async.security import ServerKeys, ipc_endpoint
from rlix_async.transport import CallContext, PeerInfo, RpcServer, TransportConfig
from rlix_async.weights.ref import CacheRef

log = logging.getLogger(__name__)


class Coordinator(PlanRealiser):
    def __init__(
        self,
        endpoint: str,
        shape: ClusterShape,
        *,
        journal: str | Path | None = None,
        keys: ServerKeys | None = None,
        transport: TransportConfig | None = None,
        config: SchedulerConfig | None = None,
        on_status: Callable[[m.StatusReply], None] | None = None,
    ) -> None:
        self.cfg = config or SchedulerConfig()
        # told the status after every plan, applied or refused (Prometheus metrics)
        self.on_status = on_status
        self.registry = Registry(shape, self.cfg.policy)
        self.journal_path = journal
        self.journal = Journal(None)
        self.server = RpcServer(
            endpoint,
            keys=keys,
            config=transport,
            name="coordinator",
            on_peer_joined=self._peer_joined,
            on_peer_lost=self._peer_lost,
        )
        self.server.admit_peer = self._admit_peer
        self.tasks = Supervisor("coordinator")
        self._wake = asyncio.Event()
        self._unfenced = asyncio.Event()
        self._journaled_fences: set[tuple[str, int]] = set()
        self._sleeping: set[tuple[str, int]] = set()
        self.weights: dict[str, CacheRef] = {}  # latest promoted version per pipeline
        self.shard_versions: dict[tuple[str, int], int | None] = {}  # acked by workers
        self.shard_endpoints: dict[tuple[str, int], str] = {}  # data planes, for routers
        self.shard_memory: dict[tuple[str, int], int] = {}  # bytes in use, last acked
        self.plans = 0
        self.rejected_plans = 0
        self._closed = False
        s = self.server
        s.on(m.AllocatePipelineId, self._allocate)
        s.on(m.RegisterPipeline, self._register)
        s.on(m.AdmitPipeline, self._admit)
        s.on(m.RequestStage, self._request)
        s.on(m.ReleaseStage, self._release)
        s.on(m.ReleaseAndRequest, self._release_and_request)
        s.on(m.ShrinkAll, self._shrink_all)
        s.on(m.ReportProgress, self._progress)
        s.on(m.ClearProgress, self._clear_progress)
        s.on(m.Unregister, self._unregister)
        s.on(m.Resume, self._resume)
        s.on(m.StatusRequest, lambda msg, ctx: self.status())
        s.on(m.PublishWeights, self._publish_weights)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    async def start(self) -> Coordinator:
        if self.journal_path is not None:
            n = replay(self.journal_path, self.registry)
            now = time.monotonic()
            for p in self.registry.pipelines.values():  # until their drivers come back
                p.connected, p.lost_at = False, now
            self._journaled_fences = set(self.registry.fences)
            if n:
                log.info(
                    "journal %s: %d events replayed, %d pipelines recovered",
                    self.journal_path,
                    n,
                    len(self.registry.pipelines),
                )
            self.journal = Journal(self.journal_path)
        await self.server.start()
        for pid, rank in list(self.registry.fences):  # replayed: lifted by their workers'
            self.tasks.spawn(self._sleep_rank(pid, rank), "sleep-replayed")  # return (or now)
        self.tasks.spawn(self._scheduler_loop(), "scheduler")
        self.tasks.spawn(self._lease_loop(), "leases")
        return self

    async def close(self) -> None:
        self._closed = True
        await self.tasks.close()
        await self.server.close()
        self.journal.close()

    async def __aenter__(self) -> Coordinator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def kick(self) -> None:
        self._wake.set()

    # --- handlers ---------------------------------------------------------------------------

    def _allocate(self, msg: m.AllocatePipelineId, ctx: CallContext) -> m.PipelineIdReply:
        return m.PipelineIdReply(pipeline_id=self.registry.allocate_id(msg.kind))

    def _register(self, msg: m.RegisterPipeline, ctx: CallContext) -> Ok:
        old = self.registry.pipelines.get(msg.pipeline_id)
        restarted = old is not None and old.registered
        p = self.registry.register(msg.pipeline_id, dict(msg.clusters))
        p.connected, p.lost_at = True, None
        self.journal.record(ev.Registered(pipeline=p.id, clusters=p.clusters))
        self._check_bound_workers(p.id)
        if restarted:
            # A new driver process for a known pipeline (it was restarted, e.g. with
            # --resume): it holds no stage and waits for nothing the old one asked;
            # its awake rollout shards carry on, and it must hear which they are.
            for cluster in list(p.held):
                del p.held[cluster]
                self.journal.record(ev.Released(pipeline=p.id, cluster=cluster))
            p.requests.clear()
            self.tasks.spawn(self._notify_ranks(p.id), "ranks")
            self.kick()
        return Ok()

    def _admit(self, msg: m.AdmitPipeline, ctx: CallContext) -> Ok:
        self.registry.admit(msg.pipeline_id)
        self.journal.record(ev.Admitted(pipeline=msg.pipeline_id))
        self.kick()
        return Ok()

    def _request(self, msg: m.RequestStage, ctx: CallContext) -> Ok:
        p = self.registry.get(msg.pipeline_id)
        if p.held.get(msg.cluster) == Priority[msg.priority]:
            # Already granted, the notification was lost (e.g. across a restart): repeat it.
            self._regrant(p.id, msg.cluster)
            return Ok()
        req = self.registry.request(
            msg.pipeline_id, msg.cluster, Priority[msg.priority], msg.step_target_estimate
        )
        self.journal.record(
            ev.Requested(
                pipeline=msg.pipeline_id, cluster=msg.cluster, priority=msg.priority, seq=req.seq
            )
        )
        self.kick()
        return Ok()

    def _release(self, msg: m.ReleaseStage, ctx: CallContext) -> Ok:
        if self.registry.release(msg.pipeline_id, msg.cluster):
            self.journal.record(ev.Released(pipeline=msg.pipeline_id, cluster=msg.cluster))
        self.kick()
        return Ok()

    def _release_and_request(self, msg: m.ReleaseAndRequest, ctx: CallContext) -> Ok:
        self.registry.get(msg.pipeline_id)
        self._release(m.ReleaseStage(pipeline_id=msg.pipeline_id, cluster=msg.release), ctx)
        return self._request(msg.request, ctx)

    async def _shrink_all(self, msg: m.ShrinkAll, ctx: CallContext) -> Ok:
        p = self.registry.get(msg.pipeline_id)
        p.progress.clear()
        gen = p.requests.get(INFER)
        if gen is not None and gen.priority == Priority.GENERATION:
            del p.requests[INFER]
        if p.active:
            shrink = Plan(shrink=[RankChange(p.id, INFER, sorted(p.active))])
            self._apply(shrink)
            await self._realise(shrink, [])
        self.kick()
        return Ok()

    def _progress(self, msg: m.ReportProgress, ctx: CallContext) -> None:
        self.registry.report_progress(msg.pipeline_id, msg.stream, msg.target, msg.completed)
        self.journal.record(
            ev.ProgressReported(
                pipeline=msg.pipeline_id,
                stream=msg.stream,
                target=msg.target,
                completed=msg.completed,
            )
        )
        self.kick()

    def _clear_progress(self, msg: m.ClearProgress, ctx: CallContext) -> None:
        self.registry.clear_progress(msg.pipeline_id, msg.stream)
        self.journal.record(ev.ProgressCleared(pipeline=msg.pipeline_id, stream=msg.stream))
        self.kick()

    def _publish_weights(self, msg: m.PublishWeights, ctx: CallContext) -> Ok:
        """Selective sync: only this pipeline's awake, stale shards are told to pull;
        sleeping ones catch up when they wake. Each sync runs on its own task, so
        no pipeline or scheduling decision waits for another's transfer."""
        p = self.registry.get(msg.pipeline_id)
        self.weights[p.id] = msg.ref
        self.journal.record(ev.WeightsPublished(pipeline=p.id, version=msg.ref.version))
        for rank in sorted(p.active):
            if self.shard_versions.get((p.id, rank)) != msg.ref.version:
                self.tasks.spawn(self._sync_rank(p.id, rank), "sync")
        return Ok()

    def _unregister(self, msg: m.Unregister, ctx: CallContext) -> Ok:
        self._drop_pipeline(msg.pipeline_id, "unregistered")
        return Ok()

    def _resume(self, msg: m.Resume, ctx: CallContext) -> Ok:
        """A driver back after a coordinator restart (or a blip) re-asserts its state."""
        pid = msg.pipeline_id
        known = pid in self.registry.pipelines and self.registry.pipelines[pid].registered
        p = self.registry.register(pid, dict(msg.clusters))
        if not known:
            self.journal.record(ev.Registered(pipeline=pid, clusters=p.clusters))
        self._check_bound_workers(pid)
        p.connected, p.lost_at = True, None
        if msg.admitted and not p.admitted:
            self.registry.admit(pid)
            self.journal.record(ev.Admitted(pipeline=pid))
        owners = self.registry.owners()
        for cluster, prio in msg.held.items():
            if cluster in p.held:
                continue
            devices = p.clusters[cluster].devices
            clash = {str(o) for d in devices if (o := owners[d]) is not None}
            clash |= {str(f) for f in self.registry.blocking_fences(devices)}
            if clash:
                raise RegistryError(
                    "lease_conflict",
                    f"{pid} claims {cluster} but devices are held by {sorted(clash)}",
                )
            p.held[cluster] = Priority[prio]
            self.journal.record(
                ev.Granted(pipeline=pid, cluster=cluster, priority=prio, devices=list(devices))
            )
        waiting_for = {r.cluster: r.priority for r in msg.requests}
        for cluster in [c for c in p.held if c not in msg.held]:
            if waiting_for.get(cluster) == p.held[cluster].name:
                self._regrant(pid, cluster)  # granted, but the driver never heard
                continue
            del p.held[cluster]
            self.journal.record(ev.Released(pipeline=pid, cluster=cluster))
        for r in msg.requests:
            if r.cluster not in p.held:
                self.registry.request(pid, r.cluster, Priority[r.priority], r.step_target_estimate)
        self.tasks.spawn(self._notify_ranks(pid), "ranks")
        self.kick()
        return Ok()

    def _regrant(self, pid: str, cluster: ClusterName) -> None:
        """Repeat a grant whose notification was lost; like the first one, it goes out
        only once no fence covers its devices."""
        p = self.registry.pipelines[pid]
        devices = list(p.clusters[cluster].devices)
        self.tasks.spawn(
            self._grant(pid, cluster, priority_name(p.held[cluster]), devices), "regrant"
        )

    def status(self) -> m.StatusReply:
        pipes = [
            m.PipelineStatus(
                id=p.id,
                admitted=p.admitted,
                connected=p.connected,
                held={c: priority_name(pr) for c, pr in p.held.items()},
                active_ranks=sorted(p.active),
                remaining=p.remaining(),
                requests={c: priority_name(r.priority) for c, r in p.requests.items()},
                shard_memory={r: b for (q, r), b in self.shard_memory.items() if q == p.id},
            )
            for p in self.registry.pipelines.values()
        ]
        return m.StatusReply(
            devices=self.registry.shape.num_devices,
            owners=self.registry.owners(),
            pipelines=pipes,
            plans=self.plans,
            rejected_plans=self.rejected_plans,
            fenced=[
                m.FenceStatus(
                    pipeline=f.pipeline,
                    rank=f.rank,
                    devices=list(f.devices),
                    holder=f.holder,
                    reason=f.reason,
                    age_s=round(time.monotonic() - f.since, 1),
                )
                for f in self.registry.fences.values()
            ],
        )

    # --- peers and leases ----------------------------------------------------------------------

    def _admit_peer(self, identity: str, info: dict[str, object]) -> None:
        """Refuse (at hello) a shard worker bound to devices that are not its rank's."""
        shard = m.shard_rank(identity)
        devices = info.get("devices")
        if shard is None or not devices:
            return  # a worker that binds no devices itself (library use) is not checked
        pid, rank = shard
        p = self.registry.pipelines.get(pid)
        spec = p.clusters.get(INFER) if p is not None else None
        if spec is None:
            return  # its pipeline registers later: checked then
        expected = list(spec.bundle(rank)) if rank < spec.dp else []
        if list(devices) != expected:  # type: ignore[call-overload]
            raise RegistryError(
                "wrong_devices",
                f"shard {identity} is bound to devices {devices} but rank {rank} of "
                f"{pid}/{INFER} has devices {expected}",
            )

    def _check_bound_workers(self, pid: str) -> None:
        """Shard workers usually say hello before their pipeline registers, when their
        devices cannot be checked yet: check them now. A misbound one is disconnected
        (its hello is refused from now on) and its rank never started."""
        p = self.registry.pipelines[pid]
        for ident, info in list(self.server.peers.items()):
            shard = m.shard_rank(ident)
            if shard is None or shard[0] != pid:
                continue
            try:
                self._admit_peer(ident, info.info)
            except RegistryError as exc:
                log.error("%s; rank %s will not be started", exc.detail, shard[1])
                p.offline.add(shard[1])
                self.server.drop_peer(ident)

    def _peer_joined(self, info: PeerInfo) -> None:
        shard = m.shard_rank(info.identity)
        if shard is not None:
            pid, rank = shard
            p = self.registry.pipelines.get(pid)
            incarnation = f"{info.host}:{info.pid}"
            if self.registry.workers.get((pid, rank)) != incarnation:
                self.journal.record(
                    ev.ShardJoined(pipeline=pid, rank=rank, incarnation=incarnation)
                )
            lifted = self.registry.worker_joined(pid, rank, incarnation)
            if lifted is not None:
                log.warning(
                    "%s: a new worker (%s) replaced %s: fence on devices %s lifted",
                    info.identity,
                    incarnation,
                    lifted.holder,
                    list(lifted.devices),
                )
                self._journal_fences()
            elif (pid, rank) in self.registry.fences:
                # the same process is back (a blip): it must confirm its sleep
                self.tasks.spawn(self._sleep_rank(pid, rank), "sleep-rejoined")
            if info.info.get("data_endpoint"):
                self.shard_endpoints[(pid, rank)] = str(info.info["data_endpoint"])
            if p is not None and rank in p.offline:
                p.offline.discard(rank)  # back: it may be started again
                self.kick()
            if p is not None and rank in p.active:
                # its rank was already awake in the plan (it started late, or we
                # restarted): make the worker match; wake is idempotent
                self.tasks.spawn(self._expand_joined(pid, rank), "wake-joined")
        driver_of = m.driver_pipeline(info.identity)
        if driver_of is not None and (d := self.registry.pipelines.get(driver_of)) is not None:
            d.connected, d.lost_at = True, None

    def _peer_lost(self, info: PeerInfo) -> None:
        shard = m.shard_rank(info.identity)
        if shard is not None:
            # A lost worker may still hold its devices (silent is not dead): its rank
            # leaves the plan and stays fenced until a replacement says hello.
            pid, rank = shard
            p = self.registry.pipelines.get(pid)
            if p is not None:
                if rank in p.active:
                    log.warning("shard worker %s lost: rank %s fenced", info.identity, rank)
                p.offline.add(rank)  # not started again until its worker returns
                self._give_up_rank(pid, rank, "worker lost")
            f = self.registry.fences.get((pid, rank))
            if f is not None and not f.reason.startswith("worker lost"):
                f.reason = f"worker lost ({f.reason})"
            self.shard_versions.pop((pid, rank), None)
            return
        driver_of = m.driver_pipeline(info.identity)
        if driver_of is not None and (d := self.registry.pipelines.get(driver_of)) is not None:
            d.connected, d.lost_at = False, time.monotonic()
            log.warning(
                "driver of %s lost; its leases expire in %.1fs unless it returns",
                driver_of,
                self.cfg.lease_timeout_s,
            )

    async def _lease_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(min(0.5, self.cfg.lease_timeout_s / 4))
            now = time.monotonic()
            for p in list(self.registry.pipelines.values()):
                if p.lost_at is not None and now - p.lost_at > self.cfg.lease_timeout_s:
                    self._drop_pipeline(p.id, "lease expired")

    def _drop_pipeline(self, pid: str, reason: str) -> None:
        p = self.registry.remove(pid, fence=True)
        if p is None:
            return
        self.weights.pop(pid, None)
        log.warning(
            "pipeline %s dropped (%s): releasing %s and %d rollout ranks",
            pid,
            reason,
            sorted(p.held),
            len(p.active),
        )
        for cluster in p.held:
            self.journal.record(ev.Released(pipeline=pid, cluster=cluster))
        if p.active:
            self.journal.record(
                ev.Shrunk(
                    pipeline=pid,
                    cluster=INFER,
                    ranks=sorted(p.active),
                    devices=devices_of(p.clusters[INFER], p.active),
                )
            )
            for r in p.active:  # put its shards to sleep: fenced until they confirm
                self.tasks.spawn(self._sleep_rank(pid, r), "sleep-dropped")
        self.journal.record(ev.Unregistered(pipeline=pid, reason=reason))
        self._journal_fences()
        self.kick()

    # --- scheduling -------------------------------------------------------------------------------

    async def _scheduler_loop(self) -> None:
        while not self._closed:
            with contextlib.suppress(TimeoutError):  # asyncio.timeout never swallows a cancel
                async with asyncio.timeout(self.cfg.rebalance_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                self.schedule_once()
            except Exception:  # a planner bug must not stop scheduling for everyone
                log.exception("scheduling step failed; will retry on the next event")

    def schedule_once(self) -> Plan | None:
        snap = self.registry.snapshot()
        result = plan(snap)
        violations = check_plan(snap, result)
        if violations:
            self.rejected_plans += 1
            self._tell_status()
            log.error(
                "plan rejected, not applied: %s\nsnapshot: %s\nplan: %s",
                violations,
                msgspec.json.encode(snap).decode(),
                msgspec.json.encode(result).decode(),
            )
            return None
        changes = bool(result.grants or result.shrink or result.expand)
        # apply() also answers GENERATION requests of pipelines already rolling out.
        answered = self._apply(result)
        if not changes and not answered:
            return result
        self.plans += changes
        self._tell_status()
        self.tasks.spawn(self._realise(result, answered), "realise")
        return result

    def _tell_status(self) -> None:
        if self.on_status is not None:
            try:
                self.on_status(self.status())
            except Exception:  # an observer's failure must not stop scheduling
                log.exception("status observer failed")


async def serve(cfg: CoordinatorConfig) -> None:
    """The coordinator process: serve until SIGINT or SIGTERM (``rlix-async coordinator``)."""
    from rlix_async.observe.metrics import Metrics

    metrics = Metrics(cfg.metrics_port) if cfg.metrics_port is not None else None
    coord = Coordinator(
        cfg.endpoint or ipc_endpoint("coordinator"),
        cfg.cluster,
        journal=cfg.journal,
        keys=ServerKeys.load(cfg.keys) if cfg.keys else None,
        transport=TransportConfig.with_heartbeat(cfg.heartbeat_interval_s),
        config=cfg.scheduler,
        on_status=metrics.update if metrics is not None else None,
    )
    try:
        await coord.start()
        print(f"READY {coord.endpoint}", flush=True)
        await until_signalled()
        await coord.close()
    finally:
        if metrics is not None:
            metrics.close()
