"""The coordinator: one asyncio process that owns which device is held by whom.

Handlers mutate the :class:`Registry` and wake the scheduler loop. The loop
plans (pure planner), refuses any plan that breaks an invariant, records the
plan's outcome in the registry and the journal, then carries it out in
background tasks (:mod:`rlix_async.control.plan_execution`: shrinks first; a
grant or an expand waits only for the shrinks on its own devices; every command
has a timeout).

It is built from parts, each with its own state: the :class:`Registry` (who
holds what), the :class:`Journal`, the :class:`PlanExecutor` (commands to shards,
notifications to drivers, the shard tables and fences) and the
:class:`LeaseKeeper` (workers and drivers coming and going). The coordinator
holds them, authorizes calls, runs the scheduler loop and answers the handlers.

Fault isolation: a driver that stops heartbeating keeps its leases for
``lease_timeout_s`` (it may be reconnecting), then loses them; nobody else is
affected. Restart: the journal rebuilds registrations, stages held and ranks
awake; reconnecting drivers re-assert their state with ``Resume``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from rlix_async.aio import Supervisor
from rlix_async.config import SchedulerConfig
from rlix_async.control import journal as ev
from rlix_async.control.allowances import check_allowances, check_claim, check_priority
from rlix_async.control.cluster_status import cluster_status
from rlix_async.control.journal import Journal, JournalWriteError, SharedFsync, open_journal
from rlix_async.control.leases import LeaseKeeper
from rlix_async.control.plan_checks import check_plan, idle_after
from rlix_async.control.plan_execution import PlanExecutor
from rlix_async.control.planner import plan
from rlix_async.control.planner_proc import PlannerProcess
from rlix_async.control.registry import Registry, RegistryError
from rlix_async.protocol import ErrorCode, Ok
from rlix_async.protocols import messages as m
from rlix_async.protocols.cache_ref import BadRef
from rlix_async.protocols.cadence import PlanCadence, progress_is_urgent
from rlix_async.protocols.snapshot import Plan, RankChange, Snapshot
from rlix_async.protocols.topology import (
    INFER,
    ClusterShape,
    Priority,
)
from rlix_async.security import ServerKeys
from rlix_async.transport import CallContext, Deferred, RpcServer, TransportConfig

log = logging.getLogger(__name__)

CRITICAL_SCHEDULER = "scheduler"
CRITICAL_LEASES = "leases"


class Coordinator:
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
        # a bad allowance stops the start; a driver key without one is named
        if keys is not None and (unlimited := check_allowances(keys.access)):
            log.warning("driver keys with no allowance (any devices, weight): %s", unlimited)
        self.server = RpcServer(endpoint, keys=keys, config=transport, name="coordinator")
        self.tasks = Supervisor("coordinator", on_failure=self._task_failed)
        self.executor = PlanExecutor(
            self.server, self.registry, lambda: self.journal, self.cfg, self.tasks, self.kick
        )
        self.leases = LeaseKeeper(
            self.server, self.registry, lambda: self.journal, self.cfg, self.executor, self.kick
        )
        self.server.on_peer_joined = self.leases.peer_joined
        self.server.on_peer_lost = self.leases.peer_lost
        self.server.admit_peer = self.leases.admit_peer
        # Set when a loop the coordinator cannot work without died: serve() exits
        # non-zero so the launcher restarts it on its journal, instead of a process
        # that answers calls but never schedules or expires a lease again.
        self.fatal: asyncio.Future[str] | None = None
        self._wake = asyncio.Event()
        self.cadence = PlanCadence(
            self.cfg.plan_interval_s, self.cfg.progress_interval_s, self.cfg.rebalance_s
        )
        self.group_sync = SharedFsync(lambda: self.journal)  # (start() may reopen it)
        self.plans = 0
        self.rejected_plans = 0
        self.stale_plans = 0  # planned in the thread, out of date when back: planned again
        self.plan_seconds = 0.0  # time spent planning, all plans (bench coordinator reads it)
        # The planner runs off the event loop: at 4096 devices x 256 pipelines a plan
        # costs tens of ms, which on the loop would delay every call and heartbeat
        # behind it. This thread plans, or waits (GIL released) for the planner
        # process to. One thread: plans are sequential anyway.
        self._planner = ThreadPoolExecutor(1, thread_name_prefix="planner")
        self.planner_process = PlannerProcess() if self.cfg.planner_process else None
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
        s.on(m.ReportPace, self._pace)
        s.on(m.Unregister, self._unregister)
        s.on(m.Resume, self._resume)
        s.on(m.StatusRequest, self._status)
        s.on(m.PublishWeights, self._publish_weights)

    @property
    def endpoint(self) -> str:
        return self.server.endpoint

    async def start(self) -> Coordinator:
        if self.journal_path is not None:
            self.journal, stats = open_journal(self.journal_path, self.registry)
            self.journal.on_error = self._journal_failed
            n = stats.events
            if stats.skipped or stats.unreadable or stats.cut_bytes:
                log.warning(
                    "journal %s: %d events skipped (no longer applied), %d unreadable "
                    "lines, %d bytes of torn tail cut off",
                    self.journal_path,
                    stats.skipped,
                    stats.unreadable,
                    stats.cut_bytes,
                )
            now = time.monotonic()
            # lost until their drivers return (a base group has none: it lives by its members)
            for p in [q for q in self.registry.pipelines.values() if not q.members]:
                p.connected, p.lost_at = False, now
            self.executor.journaled_fences = set(self.registry.fences)
            self.registry.fences.take_changed()  # replayed: journaled already
            if n:
                log.info(
                    "journal %s: %d events replayed, %d pipelines recovered",
                    self.journal_path,
                    n,
                    len(self.registry.pipelines),
                )
        self.fatal = asyncio.get_running_loop().create_future()
        await self.server.start()
        if self.planner_process is not None:
            self.planner_process.start()
        for pid, rank in list(self.registry.fences):  # replayed: lifted by their workers'
            self.tasks.spawn(self.executor.sleep_rank(pid, rank), "sleep-replayed")  # return
        self.tasks.spawn(self._scheduler_loop(), CRITICAL_SCHEDULER)
        self.tasks.spawn(self.leases.lease_loop(), CRITICAL_LEASES)
        if self.registry.pipelines:  # replayed: awake ranks whose worker never returns
            self.tasks.spawn(self.leases.expire_phantom_ranks(), "phantom-ranks")
        return self

    def _journal_failed(self, exc: JournalWriteError) -> None:
        """The registry holds an event the journal does not: nothing more is carried
        out; the coordinator exits and is restarted on what was written."""
        if self.fatal is not None and not self.fatal.done():
            self.fatal.set_result(f"journal write failed: {exc}")

    def _task_failed(self, name: str, exc: BaseException) -> None:
        if name.split(":", 1)[-1] in (CRITICAL_SCHEDULER, CRITICAL_LEASES):
            if self.fatal is not None and not self.fatal.done():
                self.fatal.set_result(f"{name} died: {type(exc).__name__}: {exc}")
        elif self.fatal is not None and not self._closed:
            self.kick()  # a failed realisation may have left work for the next plan

    async def close(self) -> None:
        self._closed = True
        await self.tasks.close()
        self._planner.shutdown(wait=False, cancel_futures=True)
        if self.planner_process is not None:
            await asyncio.to_thread(self.planner_process.close)
        await self.server.close()
        self.journal.close()

    async def __aenter__(self) -> Coordinator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def kick(self, progress: bool = False) -> None:
        """Plan soon; for progress only, within ``progress_interval_s`` (cadence.py)."""
        self.cadence.progress() if progress else self.cadence.urgent()
        self._wake.set()

    # --- authorization ----------------------------------------------------------------------

    def _authorize(self, ctx: CallContext, pid: str) -> None:
        """A handler acts for pipeline ``pid`` only for its driver (the identity the
        transport bound to the caller's key) or an admin; nobody else, whatever
        the message says."""
        p = self.registry.pipelines.get(pid)
        if p is not None and p.members:  # its shards' owner, not a pipeline anyone drives
            raise RegistryError(
                ErrorCode.FORBIDDEN, f"{pid} is a base group: act for its members {p.members}"
            )
        if m.driver_pipeline(ctx.peer) == pid or _is_admin(ctx):
            return
        raise RegistryError(ErrorCode.FORBIDDEN, f"{ctx.peer} may not act for pipeline {pid!r}")

    # --- handlers ---------------------------------------------------------------------------

    def _allocate(self, msg: m.AllocatePipelineId, ctx: CallContext) -> m.PipelineIdReply:
        pr = ctx.principal
        if pr is not None and not (
            pr.role == "admin" or (pr.role == "driver" and pr.pipelines is None)
        ):
            raise RegistryError(
                ErrorCode.FORBIDDEN, f"{pr.describe()} may not allocate pipeline ids"
            )
        pid = self.registry.allocate_id(msg.kind)
        p = self.registry.pipelines[pid]
        # reaped by the lease loop unless a driver registers it in time
        p.connected, p.lost_at = False, time.monotonic()
        return m.PipelineIdReply(pipeline_id=pid)

    def _register(self, msg: m.RegisterPipeline, ctx: CallContext) -> Ok:
        self._authorize(ctx, msg.pipeline_id)
        check_claim(ctx.principal, msg.pipeline_id, msg.clusters, msg.weight, msg.group)
        self.leases.limit_holds(msg.pipeline_id, ctx.principal)
        old = self.registry.pipelines.get(msg.pipeline_id)
        restarted = old is not None and old.registered
        driver = m.driver_identity(msg.pipeline_id)
        if restarted and ctx.peer != driver and driver in self.server.peers:
            raise RegistryError(
                "pipeline_live",
                f"{msg.pipeline_id} is registered and its driver is connected: "
                "unregister it first (rlix-async kill)",
            )
        self.leases.check_group_workers(msg.pipeline_id, msg.group)
        p = self.registry.register(msg.pipeline_id, dict(msg.clusters), msg.weight, msg.group)
        p.connected, p.lost_at = True, None
        self.journal.record(
            ev.Registered(pipeline=p.id, clusters=p.clusters, weight=p.weight, group=p.group)
        )
        self.leases.check_bound_workers(p.group or p.id)
        if restarted:
            # A new driver process for a known pipeline (it was restarted, e.g. with
            # --resume): it holds no stage and waits for nothing the old one asked;
            # its awake rollout shards carry on, and it must hear which they are.
            for cluster in list(p.held):
                del p.held[cluster]
                self.journal.record(ev.Released(pipeline=p.id, cluster=cluster))
            p.requests.clear()
            self.registry.restarted(p.id)
            self.tasks.spawn(self.executor.notify_ranks(p.id), "ranks")
            self.kick()
        return Ok()

    def _admit(self, msg: m.AdmitPipeline, ctx: CallContext) -> Ok:
        self._authorize(ctx, msg.pipeline_id)
        self.registry.admit(msg.pipeline_id)
        self.journal.record(ev.Admitted(pipeline=msg.pipeline_id))
        self.kick()
        return Ok()

    def _request(self, msg: m.RequestStage, ctx: CallContext) -> Ok:
        self._authorize(ctx, msg.pipeline_id)
        check_priority(ctx.principal, msg.pipeline_id, msg.priority)
        p = self.registry.get(msg.pipeline_id)
        if p.held.get(msg.cluster) == Priority[msg.priority]:
            # Already granted, the notification was lost (e.g. across a restart): repeat it.
            self.executor.regrant(p.id, msg.cluster)
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

    def _release(self, msg: m.ReleaseStage, ctx: CallContext) -> Ok | Deferred:
        """Released at once; the reply waits for the fsync it shares with the other
        calls of this loop turn (releases come in bursts: ``SharedFsync``)."""
        self._released(msg, ctx)
        return self.group_sync.reply_after(Ok())

    def _released(self, msg: m.ReleaseStage, ctx: CallContext) -> None:
        self._authorize(ctx, msg.pipeline_id)
        if self.registry.release(msg.pipeline_id, msg.cluster):
            released = ev.Released(pipeline=msg.pipeline_id, cluster=msg.cluster)
            self.journal.record(released, sync=False)
        self.kick()

    def _release_and_request(self, msg: m.ReleaseAndRequest, ctx: CallContext) -> Ok | Deferred:
        self._authorize(ctx, msg.pipeline_id)
        self.registry.get(msg.pipeline_id)
        self._released(m.ReleaseStage(pipeline_id=msg.pipeline_id, cluster=msg.release), ctx)
        try:
            reply = self._request(msg.request, ctx)
        except Exception:  # refused: the release stands, durable before the refusal goes
            self.journal.sync()
            raise
        return self.group_sync.reply_after(reply)

    async def _shrink_all(self, msg: m.ShrinkAll, ctx: CallContext) -> Ok:
        self._authorize(ctx, msg.pipeline_id)
        p = self.registry.get(msg.pipeline_id)
        p.progress.clear()
        gen = p.requests.get(INFER)
        if gen is not None and gen.priority == Priority.GENERATION:
            del p.requests[INFER]
        if p.active:
            shrink = Plan(shrink=[RankChange(p.id, INFER, sorted(p.active))])
            self.executor.apply(shrink)
            await self.executor.execute(shrink, [])
        self.kick()
        return Ok()

    def _progress(self, msg: m.ReportProgress, ctx: CallContext) -> None:
        self._authorize(ctx, msg.pipeline_id)
        last = self.registry.get(msg.pipeline_id).progress.get(msg.stream)
        before = None if last is None else (last.target, last.completed)
        self.registry.report_progress(msg.pipeline_id, msg.stream, msg.target, msg.completed)
        self.journal.record(
            ev.ProgressReported(
                pipeline=msg.pipeline_id,
                stream=msg.stream,
                target=msg.target,
                completed=msg.completed,
            )
        )
        self.kick(progress=not progress_is_urgent(before, msg.target, msg.completed))

    def _pace(self, msg: m.ReportPace, ctx: CallContext) -> None:
        """Advisory, as progress is, and not journaled: a driver sends it after every
        step and again on resume, so a restarted coordinator has it back within a step."""
        self._authorize(ctx, msg.pipeline_id)
        self.registry.report_pace(msg.pipeline_id, msg.exclusive_step_s)
        self.kick(progress=True)

    def _clear_progress(self, msg: m.ClearProgress, ctx: CallContext) -> None:
        self._authorize(ctx, msg.pipeline_id)
        self.registry.clear_progress(msg.pipeline_id, msg.stream)
        self.journal.record(ev.ProgressCleared(pipeline=msg.pipeline_id, stream=msg.stream))
        self.kick()

    def _publish_weights(self, msg: m.PublishWeights, ctx: CallContext) -> Ok:
        """Selective sync: only this pipeline's awake, stale shards are told to pull;
        sleeping ones catch up when they wake. Each sync runs on its own task, so
        no pipeline or scheduling decision waits for another's transfer."""
        self._authorize(ctx, msg.pipeline_id)
        if msg.ref.pipeline != msg.pipeline_id:
            # its shards would pull (and authenticate the server) as another pipeline's
            raise RegistryError(
                ErrorCode.FORBIDDEN,
                f"{msg.pipeline_id} may not publish weights of pipeline {msg.ref.pipeline!r}",
            )
        try:
            msg.ref.check_names()  # its names become file names on every shard
        except BadRef as exc:
            raise RegistryError(ErrorCode.FORBIDDEN, str(exc)) from None
        p = self.registry.get(msg.pipeline_id)
        self.executor.shards.weights[p.id] = msg.ref
        self.journal.record(ev.WeightsPublished(pipeline=p.id, version=msg.ref.version))
        self.executor.sync_stale(p, msg.ref.version)
        return Ok()

    def _unregister(self, msg: m.Unregister, ctx: CallContext) -> Ok:
        self._authorize(ctx, msg.pipeline_id)
        self.leases.drop_pipeline(msg.pipeline_id, "unregistered")
        return Ok()

    def _resume(self, msg: m.Resume, ctx: CallContext) -> Ok:
        """A driver back after a coordinator restart (or a blip) re-asserts its state."""
        self._authorize(ctx, msg.pipeline_id)
        check_claim(ctx.principal, msg.pipeline_id, msg.clusters, msg.weight, msg.group)
        for priority in [*msg.held.values(), *(r.priority for r in msg.requests)]:
            check_priority(ctx.principal, msg.pipeline_id, priority)
        self.leases.limit_holds(msg.pipeline_id, ctx.principal)
        driver = m.driver_identity(msg.pipeline_id)
        if ctx.peer != driver and driver in self.server.peers:
            raise RegistryError(
                "pipeline_live", f"{msg.pipeline_id}'s driver is connected: only it may resume"
            )
        pid = msg.pipeline_id
        prev = self.registry.pipelines.get(pid)
        known = prev is not None and prev.registered
        held_now = prev.held if prev is not None else {}
        owners = self.registry.owners()
        claimed = [c for c in msg.held if c not in held_now]
        for cluster in claimed:  # every claim checked before anything is applied
            spec = msg.clusters.get(cluster)
            if spec is None:
                raise RegistryError("bad_resume", f"{pid} claims {cluster}, which it does not have")
            clash = {
                str(o) for d in spec.devices if d < len(owners) and (o := owners[d]) is not None
            }
            clash |= {str(f) for f in self.registry.fences.covering(spec.devices)}
            if clash:
                raise RegistryError(
                    "lease_conflict",
                    f"{pid} claims {cluster} but its devices are held by {sorted(clash)}; "
                    "nothing of this resume was applied",
                )
        reweighted = known and self.registry.pipelines[pid].weight != msg.weight
        self.leases.check_group_workers(pid, msg.group)
        p = self.registry.register(pid, dict(msg.clusters), msg.weight, msg.group)
        if not known or reweighted:
            self.journal.record(
                ev.Registered(pipeline=pid, clusters=p.clusters, weight=p.weight, group=p.group)
            )
        self.leases.check_bound_workers(p.group or pid)
        p.connected, p.lost_at = True, None
        if msg.admitted and not p.admitted:
            self.registry.admit(pid)
            self.journal.record(ev.Admitted(pipeline=pid))
        for cluster in claimed:
            prio = msg.held[cluster]
            p.held[cluster] = Priority[prio]
            self.journal.record(
                ev.Granted(
                    pipeline=pid,
                    cluster=cluster,
                    priority=prio,
                    devices=list(p.clusters[cluster].devices),
                )
            )
        waiting_for = {r.cluster: r.priority for r in msg.requests}
        for cluster in [c for c in p.held if c not in msg.held]:
            if waiting_for.get(cluster) == p.held[cluster].name:
                self.executor.regrant(pid, cluster)  # granted, but the driver never heard
                continue
            del p.held[cluster]
            self.journal.record(ev.Released(pipeline=pid, cluster=cluster))
        for r in msg.requests:
            if r.cluster not in p.held:
                self.registry.request(pid, r.cluster, Priority[r.priority], r.step_target_estimate)
        self.tasks.spawn(self.executor.notify_ranks(pid), "ranks")
        self.kick()
        return Ok()

    def _status(self, msg: m.StatusRequest, ctx: CallContext) -> m.StatusReply:
        """The whole cluster, for admins and drivers; never for a shard key."""
        pr = ctx.principal
        if pr is not None and pr.role == "shard":
            raise RegistryError(ErrorCode.FORBIDDEN, f"{pr.describe()} may not read the status")
        return self.status()

    def status(self) -> m.StatusReply:
        reply = cluster_status(
            self.registry,
            self.executor.shards.memory,
            (self.plans, self.rejected_plans, self.stale_plans),
        )
        workers: dict[str, list[int]] = {}
        for identity in self.server.peers:
            if (shard := m.shard_rank(identity)) is not None:
                workers.setdefault(shard[0], []).append(shard[1])
        reply.workers = {pid: sorted(ranks) for pid, ranks in workers.items()}
        return reply

    # --- scheduling -------------------------------------------------------------------------------

    async def _scheduler_loop(self) -> None:
        """Plan when ``self.cadence`` says (protocols/cadence.py, shared with the
        simulator), and every ``rebalance_s`` without events."""
        while not self._closed:
            self._wake.clear()
            now = time.monotonic()
            due = self.cadence.due()  # never None: rebalance_s is its timer
            assert due is not None
            if due > now:
                with contextlib.suppress(TimeoutError):  # asyncio.timeout never swallows a cancel
                    async with asyncio.timeout(due - now):
                        await self._wake.wait()
                continue  # a kick may have moved the next plan earlier
            self.cadence.started(now)
            t0 = time.perf_counter()
            try:
                await self._schedule_step()
            except Exception:  # a planner bug must not stop scheduling for everyone
                log.exception("scheduling step failed; will retry on the next event")
            took = time.perf_counter() - t0
            self.plan_seconds += took
            self.cadence.finished(time.monotonic(), took)

    async def _schedule_step(self) -> Plan | None:
        """One scheduling step with the plan computed off the loop (the planner
        process, or the planner thread: ``SchedulerConfig.planner_process``). The
        snapshot it plans on is immutable; the registry may change meanwhile, so the
        plan is checked again against the registry as it is when it comes back, and
        applied only if it still holds (else it is dropped and the next step plans
        again): a release only frees devices, a new request waits for the next plan,
        while a grant whose request was withdrawn or an expand onto devices granted
        meanwhile is refused by the check."""
        snap = self.registry.snapshot()
        loop = asyncio.get_running_loop()
        make = self.planner_process.plan if self.planner_process is not None else plan
        result = await loop.run_in_executor(self._planner, make, snap)
        if self._closed:
            return None
        now = self.registry.snapshot()
        result.idle_devices = idle_after(now, result)  # derived, not decided: of now
        return self._carry_out(now, result, planned_on=snap)

    def schedule_once(self) -> Plan | None:
        """One scheduling step, all of it on the calling thread (tests, tools)."""
        snap = self.registry.snapshot()
        return self._carry_out(snap, plan(snap))

    def _carry_out(
        self, snap: Snapshot, result: Plan, *, planned_on: Snapshot | None = None
    ) -> Plan | None:
        """Check ``result`` against ``snap`` (the registry now), apply it, realise it.
        A plan made on an older snapshot (``planned_on``) that was sound there but no
        longer is, is out of date, not wrong: dropped, and the next step plans again."""
        violations = check_plan(snap, result)
        if violations and planned_on is not None:
            stale = dict(idle_devices=idle_after(planned_on, result))
            if not check_plan(planned_on, msgspec.structs.replace(result, **stale)):
                self.stale_plans += 1
                log.info("plan out of date when made, planning again: %s", violations[:3])
                self.kick()
                return None
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
        try:
            answered = self.executor.apply(result)
        except JournalWriteError as exc:  # not carried out: we exit (see _journal_failed)
            log.error("plan not carried out: its journal write failed: %s", exc)
            return None
        if not changes and not answered:
            return result
        self.plans += changes
        self._tell_status()
        self.tasks.spawn(self.executor.execute(result, answered), "execute")
        return result

    def _tell_status(self) -> None:
        if self.on_status is not None:
            try:
                self.on_status(self.status())
            except Exception:  # an observer's failure must not stop scheduling
                log.exception("status observer failed")


def _is_admin(ctx: CallContext) -> bool:
    """An admin key on tcp; on ipc (no keys: every peer is the local user) the CLI's
    ``*/cli/*`` identities, which is what ``rlix-async kill`` and ``status`` use."""
    if ctx.principal is not None:
        return ctx.principal.role == "admin"
    return ctx.peer.split("/")[1:2] == ["cli"]
