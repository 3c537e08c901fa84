"""Carrying out a plan: the commands the coordinator sends to shard workers (sleep,
wake, sync) and the notifications its drivers get (grants, awake ranks).

Sleeps start at once; a grant or a wake waits until no fence covers its devices
(a shard's devices are fenced from the moment it leaves the plan until its
worker confirms the sleep or is replaced: docs/SCHEDULING.md, "Fenced leases").
Every command has a timeout (``command_timeout_s``; a sync gets
``sync_timeout_s``); a shard that cannot wake or sync leaves the plan, fenced.

:class:`PlanExecutor` is one part of the coordinator
(:class:`~rlix_async.control.coordinator.Coordinator` holds it): it owns the
shard tables (:class:`ShardTables`: versions, adapters, endpoints, memory) and
the journaling of fences, and reads the registry and the journal it is given.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from rlix_async.aio import Supervisor, TurnPacer
from rlix_async.config import SchedulerConfig
from rlix_async.control import journal as ev
from rlix_async.control.journal import Journal, JournalWriteError
from rlix_async.control.registry import PipelineState, Registry
from rlix_async.protocols import messages as m
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.snapshot import Plan, RankChange
from rlix_async.protocols.topology import (
    INFER,
    TRAIN,
    ClusterName,
    ClusterSpec,
    Priority,
    PriorityName,
    priority_name,
)
from rlix_async.transport import RpcServer

log = logging.getLogger("rlix_async.control.coordinator")
RESTART_ASKS = 5  # restart requests to a broken shard's worker before it is put back

UNFENCE_SYNC_S = 0.05  # lifted fences are fsynced together, this long after the first
# Execution steps (a command sent, an acknowledgement acted on, a driver notified) pass
# the pacer about this many per turn of the loop (aio.TurnPacer says why and how
# exactly): a few ms of CPU.
STEPS_PER_TURN = 32

Rank = tuple[str, int]  # (pipeline, rank) of a rollout shard


def devices_of(spec: ClusterSpec, ranks: Iterable[int]) -> list[int]:
    return sorted(d for r in ranks for d in spec.bundle(r))


@dataclass
class ShardTables:
    """What the coordinator knows of each shard besides the plan: the newest version
    each pipeline published, and what each shard acknowledged or announced."""

    weights: dict[str, CacheRef] = field(default_factory=dict)  # newest per pipeline
    versions: dict[Rank, int | None] = field(default_factory=dict)  # acked by workers
    adapters: dict[Rank, dict[str, int]] = field(default_factory=dict)  # base groups' shards
    endpoints: dict[Rank, str] = field(default_factory=dict)  # data planes, for routers
    data_keys: dict[Rank, str] = field(default_factory=dict)  # their CURVE public keys (tcp)
    memory: dict[Rank, int] = field(default_factory=dict)  # bytes in use, last acked

    def worker_gone(self, key: Rank) -> None:
        """A lost worker's entries (a replacement says hello with its own)."""
        for table in (self.versions, self.adapters, self.endpoints, self.data_keys):
            table.pop(key, None)

    def forget(self, pid: str, connected: Callable[[Rank], bool]) -> None:
        """Everything keyed by a dropped pipeline (a long-lived coordinator sees
        thousands come and go). A worker still connected keeps its data plane's
        address and key: when the pipeline returns (a trainer resumed on another
        node) its router needs them, and the worker says hello only once."""
        self.weights.pop(pid, None)
        for table in (self.versions, self.memory, self.adapters):
            for key in [k for k in table if k[0] == pid]:
                del table[key]
        for where in (self.endpoints, self.data_keys):
            for key in [k for k in where if k[0] == pid and not connected(k)]:
                del where[key]


class PlanExecutor:
    """Carries out plans on the coordinator's server (see the module docstring)."""

    def __init__(
        self,
        server: RpcServer,
        registry: Registry,
        journal: Callable[[], Journal],
        cfg: SchedulerConfig,
        tasks: Supervisor,
        kick: Callable[[], None],
    ) -> None:
        self.server = server
        self.registry = registry
        self._journal = journal  # the coordinator's current one (start() may reopen it)
        self.cfg = cfg
        self.tasks = tasks
        self.kick = kick
        self.pacer = TurnPacer(STEPS_PER_TURN)
        self.shards = ShardTables()
        self.journaled_fences: set[Rank] = set()
        self._fence_lifted: dict[Rank, asyncio.Event] = {}  # set when that fence is lifted
        self._journal_sync_due = False  # an fsync of lifted fences is scheduled
        self._sleeping: set[Rank] = set()  # ranks with a sleep (or its retries) under way
        self.failures: dict[Rank, int] = {}  # syncs and wakes failed in a row, per rank

    @property
    def journal(self) -> Journal:
        return self._journal()

    def apply(self, result: Plan) -> list[str]:
        """Record a plan in the registry (shrunk ranks fenced) and the journal."""
        with self.journal.batch():  # one fsync for the plan, before any command goes out
            answered = self.registry.apply(result, fence=True)
            self._journal_plan(result)
        return answered

    def journal_fences(self) -> None:
        """Journal fences set or lifted since the last call, and wake their waiters.
        Only the keys the registry changed are looked at (hundreds of fences stand at
        once at scale, and sleeps are confirmed one by one)."""
        fences = self.registry.fences
        changed = sorted(fences.take_changed())
        for key in changed:
            f = fences.get(key)
            if f is not None and key not in self.journaled_fences:
                self.journal.record(
                    ev.Fenced(
                        pipeline=f.pipeline,
                        rank=f.rank,
                        devices=list(f.devices),
                        holder=f.holder,
                        reason=f.reason,
                    )
                )
                self.journaled_fences.add(key)
        lifted = [k for k in changed if k not in fences and k in self.journaled_fences]
        for key in lifted:
            self.journal.record(ev.Unfenced(pipeline=key[0], rank=key[1]))
            self.journaled_fences.discard(key)
        for key in lifted:  # wake only those waiting for this fence: hundreds of sleeps
            waiters = self._fence_lifted.pop(key, None)  # are confirmed in one burst
            if waiters is not None:
                waiters.set()
        if lifted:
            self._sync_journal_soon()
            self.kick()  # the devices can be planned again

    def _sync_journal_soon(self) -> None:
        """Unfenced lines are not fsynced one by one (hundreds a second at scale, each
        a stall of the loop): one fsync covers those of the next UNFENCE_SYNC_S, so a
        power loss takes at most that much of them (events.LEASE_EVENTS says why
        losing one is safe; this keeps the window short)."""
        if self._journal_sync_due:
            return
        self._journal_sync_due = True

        def sync() -> None:
            self._journal_sync_due = False
            with contextlib.suppress(JournalWriteError):  # on_error made us fatal
                self.journal.sync()

        asyncio.get_running_loop().call_later(UNFENCE_SYNC_S, sync)

    def _journal_plan(self, result: Plan) -> None:
        for ch in result.shrink:
            self.journal.record(self._rank_event(ev.Shrunk, ch))
        for g in result.grants:
            self.journal.record(
                ev.Granted(
                    pipeline=g.pipeline, cluster=g.cluster, priority=g.priority, devices=g.devices
                )
            )
        for ch in result.expand:
            self.journal.record(self._rank_event(ev.Expanded, ch))
        self.journal_fences()

    def _rank_event(
        self, kind: type[ev.Shrunk] | type[ev.Expanded], ch: RankChange
    ) -> ev.Shrunk | ev.Expanded:
        spec = self._infer_spec(ch.pipeline)
        devices = devices_of(spec, ch.ranks) if spec else []
        return kind(pipeline=ch.pipeline, cluster=ch.cluster, ranks=ch.ranks, devices=devices)

    def _infer_spec(self, pid: str) -> ClusterSpec | None:
        p = self.registry.pipelines.get(pid)
        return p.clusters.get(INFER) if p else None

    async def execute(self, result: Plan, answered: list[str]) -> None:
        """Sleeps now; each grant or wake waits until no fence covers its devices. Each
        pipeline hears of its ranks as soon as its own wakes are done: a wake held up
        by a fence delays nobody else's notification."""
        # (a sleep's first attempt is awaited: ShrinkAll answers once its shards slept;
        # retries of a failed one run on their own)
        steps = [self.sleep_rank(ch.pipeline, r) for ch in result.shrink for r in ch.ranks]
        steps += [self._grant(g.pipeline, g.cluster, g.priority, g.devices) for g in result.grants]
        woken: dict[str, list[int]] = {}
        for ch in result.expand:
            woken.setdefault(ch.pipeline, []).extend(ch.ranks)
        shrunk = {ch.pipeline for ch in result.shrink}
        for pid in sorted(shrunk | set(woken) | set(answered)):
            steps.append(self._wake_and_notify(pid, woken.get(pid, []), pid in answered))
        await asyncio.gather(*steps, return_exceptions=True)

    async def _wake_and_notify(self, pid: str, ranks: list[int], answered: bool) -> None:
        spec = self._infer_spec(pid)
        if ranks and spec is not None:
            await self._expand(pid, ranks, spec)
        await self.notify_ranks(pid)
        p = self.registry.pipelines.get(pid)
        if answered and p is not None:
            serving = self._serving(p)
            await self.server.notify(
                m.driver_identity(pid),
                m.Granted(cluster=INFER, priority="GENERATION", ranks=sorted(serving.active)),
            )

    def _serving(self, p: PipelineState) -> PipelineState:
        """Whose shards serve ``p``'s rollouts: its own, or its base group's."""
        return self.registry.pipelines[p.group] if p.group is not None else p

    # --- fenced sleeps ----------------------------------------------------------------------

    def _incarnation(self, pid: str, rank: int) -> str | None:
        info = self.server.peers.get(m.worker_identity(pid, rank))
        return f"{info.host}:{info.pid}" if info is not None else None

    async def sleep_rank(self, pid: str, rank: int) -> None:
        """Put a shard to sleep and lift its fence once it confirms. If it cannot
        confirm, the fence stays and the sleep is retried in the background every
        ``command_timeout_s`` while the worker is connected; a worker that is gone
        stays fenced until a new incarnation says hello."""
        if await self._try_sleep(pid, rank):
            return
        if (pid, rank) not in self._sleeping:
            self._sleeping.add((pid, rank))
            self.tasks.spawn(self._retry_sleep(pid, rank), "sleep-retry")

    async def _try_sleep(self, pid: str, rank: int) -> bool:
        """One sleep command; True when the fence is lifted (or there was none)."""
        await self.pacer.turn()
        if (pid, rank) not in self.registry.fences:
            return True
        holder = self._incarnation(pid, rank)
        if holder is None:
            if self.registry.workers.get((pid, rank)) is not None:
                return False  # its worker is gone: only a replacement's hello proves it dead
            # No worker ever ran this rank (its pipeline drives its engines itself).
            self.registry.confirm_asleep(pid, rank, None)
            self.journal_fences()
            return True
        ack = await self._command(pid, rank, "sleep")
        if ack is None or ack.state != m.ShardState.ASLEEP:
            return False
        self.registry.confirm_asleep(pid, rank, holder)
        self.journal_fences()
        return (pid, rank) not in self.registry.fences

    async def _retry_sleep(self, pid: str, rank: int) -> None:
        try:
            while (pid, rank) in self.registry.fences:
                f = self.registry.fences[(pid, rank)]
                log.error("devices %s stay fenced: %s", list(f.devices), f)
                await asyncio.sleep(self.cfg.command_timeout_s)
                if self._incarnation(pid, rank) is None:
                    return  # gone: a new worker's hello lifts the fence (or retries)
                if await self._try_sleep(pid, rank):
                    log.warning("%s/%s[%d] asleep after a retry: fence lifted", pid, INFER, rank)
                    return
        finally:
            self._sleeping.discard((pid, rank))

    async def _wait_unfenced(
        self, devices: Iterable[int], what: str, wanted: Callable[[], bool]
    ) -> bool:
        """Wait until no fence covers ``devices``; False when ``wanted()`` turned false
        meanwhile (the grant or wake was withdrawn). Never proceeds on a timeout: each
        one is logged with the fences still in the way."""
        devices = list(devices)
        while blocking := self.registry.fences.covering(devices):
            if not wanted():
                return False
            f = blocking[0]  # lifted: look again (another may still be in the way)
            lifted = self._fence_lifted.setdefault((f.pipeline, f.rank), asyncio.Event())
            try:
                async with asyncio.timeout(self.cfg.command_timeout_s):
                    await lifted.wait()
            except TimeoutError:
                if wanted():
                    log.error(
                        "%s waits for devices %s: fenced by %s",
                        what,
                        devices,
                        "; ".join(map(str, blocking)),
                    )
        return wanted()

    async def _grant(
        self, pid: str, cluster: ClusterName, priority: PriorityName, devices: list[int]
    ) -> None:
        def still_granted() -> bool:
            p = self.registry.pipelines.get(pid)
            return p is not None and p.held.get(cluster) == Priority[priority]

        await self.pacer.turn()  # first: nothing may await between the checks and the send
        if await self._wait_unfenced(devices, f"grant of {cluster} to {pid}", still_granted):
            if cluster == TRAIN and priority == "ACTOR_TRAINING":
                self.registry.training_delivered(pid)
            await self.server.notify(
                m.driver_identity(pid),
                m.Granted(cluster=cluster, priority=priority, devices=devices),
            )

    def regrant(self, pid: str, cluster: ClusterName) -> None:
        """Repeat a grant whose notification was lost; like the first one, it goes out
        only once no fence covers its devices."""
        p = self.registry.pipelines[pid]
        devices = list(p.clusters[cluster].devices)
        self.tasks.spawn(
            self._grant(pid, cluster, priority_name(p.held[cluster]), devices), "regrant"
        )

    def sync_stale(self, p: PipelineState, version: int) -> None:
        """Selective sync of a new version: only ``p``'s awake shards that hold another
        are told to pull it (a member's: its base group's shards, about its adapter);
        sleeping ones catch up when they wake."""
        if p.group is not None:
            base = self.registry.pipelines[p.group]
            for rank in sorted(base.active):
                if self.shards.adapters.get((base.id, rank), {}).get(p.id) != version:
                    self.tasks.spawn(self._sync_rank(base.id, rank), "sync")
            return
        for rank in sorted(p.active):
            if self.shards.versions.get((p.id, rank)) != version:
                self.tasks.spawn(self._sync_rank(p.id, rank), "sync")

    async def _expand(self, pid: str, ranks: list[int], spec: ClusterSpec) -> None:
        await asyncio.gather(*(self._wake_rank(pid, r, spec.bundle(r)) for r in ranks))

    async def _wake_rank(self, pid: str, rank: int, bundle: tuple[int, ...]) -> None:
        """Wake a rank the plan made active, once no fence covers its devices (another
        shard's sleep may still be pending there); a failed wake gives the rank up."""

        def still_active() -> bool:
            p = self.registry.pipelines.get(pid)
            return p is not None and rank in p.active

        await self.pacer.turn()
        if not await self._wait_unfenced(bundle, f"wake of {pid}/{INFER}[{rank}]", still_active):
            return
        if await self._command(pid, rank, "wake") is None:
            self.give_up_rank(pid, rank, "wake failed")

    async def expand_joined(self, pid: str, rank: int) -> None:
        """A worker said hello while its rank is awake in the plan: wake it to match."""
        spec = self._infer_spec(pid)
        if spec is not None:
            await self._wake_rank(pid, rank, spec.bundle(rank))
            await self.notify_ranks(pid)

    async def _sync_rank(self, pid: str, rank: int) -> None:
        await self.pacer.turn()
        if await self._command(pid, rank, "sync") is None:
            self.give_up_rank(pid, rank, "sync failed")

    def give_up_rank(self, pid: str, rank: int, why: str) -> None:
        """A shard that could not wake or sync (or was lost) is not serving: take it
        out of the plan; its devices stay fenced until it is confirmed asleep or dead.
        One that failed ``shard_failures_before_restart`` times in a row is broken: it
        stays out of plans and its worker is told to exit (its launcher starts a new
        one, whose hello lifts the fence), rather than be slept, woken and failed
        again for the rest of the run."""
        p = self.registry.pipelines.get(pid)
        if p is None or rank not in p.active:
            return
        broken = False
        # counted: failures of a connected worker (one that is gone is replaced anyway)
        if why != "worker lost" and m.worker_identity(pid, rank) in self.server.peers:
            n = self.failures[(pid, rank)] = self.failures.get((pid, rank), 0) + 1
            if n >= self.cfg.shard_failures_before_restart:
                broken = True
                why = f"broken: {n} failed syncs or wakes in a row (the last: {why}); restarted"
        lost = Plan(shrink=[RankChange(pid, INFER, [rank])])
        self.registry.apply(lost)
        self.registry.fence(pid, rank, p.clusters[INFER].bundle(rank), why)
        self._journal_plan(lost)
        self.shards.versions.pop((pid, rank), None)
        self.shards.adapters.pop((pid, rank), None)
        if broken:
            log.error("%s/%s/%s: %s", pid, INFER, rank, why)
            self.failures.pop((pid, rank), None)
            p.offline.add(rank)  # not planned again until a new worker says hello
            self.tasks.spawn(self._restart_worker(pid, rank, why), "restart")
        else:
            self.tasks.spawn(self.sleep_rank(pid, rank), "sleep-failed")
        self.tasks.spawn(self.notify_ranks(pid), "ranks")
        self.kick()

    async def _restart_worker(self, pid: str, rank: int, why: str) -> None:
        """Tell a broken shard's worker to exit (a worker wedged in a sync still
        answers: the command is served outside its lock), again every
        ``command_timeout_s`` while it stays connected. One that never goes is put
        back as any failed shard is (slept, then plannable): the rank is not lost for
        the rest of the run to a restart nobody carried out."""
        ident = m.worker_identity(pid, rank)
        for _ in range(RESTART_ASKS):
            if ident not in self.server.peers:
                return  # gone: its launcher starts a new one, whose hello lifts the fence
            try:
                await self.server.call(
                    ident, m.ShardCommand(action="restart", reason=why), timeout=10.0
                )
            except Exception as exc:  # wedged beyond answering, or a blip: asked again
                log.error("restart of %s: %s", ident, exc)
            await asyncio.sleep(self.cfg.command_timeout_s)
        if ident in self.server.peers:
            log.error("%s never went after %d restart requests: put back", ident, RESTART_ASKS)
            p = self.registry.pipelines.get(pid)
            if p is not None:
                p.offline.discard(rank)
            await self.sleep_rank(pid, rank)
            self.kick()

    async def _command(self, pid: str, rank: int, action: m.ShardAction) -> m.ShardAck | None:
        """Tell shard worker ``pid/infer/rank`` to sleep, wake or sync; its
        acknowledgement, or None when it failed, timed out or the worker is gone.
        Pipelines that run their engines themselves (no worker ever said hello for
        the rank) follow ActiveRanks: a wake or sync there succeeds at once. Callers
        take their turn of the pacer *before* they check that the command is still
        wanted: nothing awaits between those checks and the send."""
        ident = m.worker_identity(pid, rank)
        if ident not in self.server.peers:
            if self.registry.workers.get((pid, rank)) is None and action != "sleep":
                return m.ShardAck(state=m.ShardState.ACTIVE)
            log.error("%s of %s: the worker is not connected", action, ident)
            return None
        weights = self.shards.weights.get(pid) if action != "sleep" else None
        adapters = self._adapters(pid) if action != "sleep" else {}
        held = self.shards.adapters.get((pid, rank), {})
        timeout = self.cfg.command_timeout_s
        if (
            weights is not None and self.shards.versions.get((pid, rank)) != weights.version
        ) or any(held.get(member) != ref.version for member, ref in adapters.items()):
            # a sync gets its own budget; a wake that syncs gets both
            timeout = (timeout if action == "wake" else 0.0) + self.cfg.sync_timeout_s
        command = m.ShardCommand(action=action, weights=weights, adapters=adapters)
        try:
            ack = await self.server.call(ident, command, timeout=timeout)
        except Exception as exc:  # stuck, failed or gone: the caller decides
            log.error("%s of %s failed: %s", action, ident, exc)
            return None
        if not isinstance(ack, m.ShardAck):
            log.error("%s of %s: unexpected reply %s", action, ident, type(ack).__name__)
            return None
        if pid in self.registry.pipelines:  # (a dropped one's last sleep leaves nothing)
            self.shards.versions[(pid, rank)] = ack.weight_version
            if adapters or ack.adapter_versions:
                self.shards.adapters[(pid, rank)] = dict(ack.adapter_versions)
        if ack.memory_bytes is not None:
            self.shards.memory[(pid, rank)] = ack.memory_bytes
        if action != "sleep" and ack.state == m.ShardState.ACTIVE:
            self.failures.pop((pid, rank), None)  # it serves: the count starts again
        log.info(
            "%s of %s: %s, version %s, %s MiB in use",
            action,
            ident,
            ack.state,
            ack.weight_version,
            None if ack.memory_bytes is None else ack.memory_bytes >> 20,
        )
        if weights is not None and ack.state == m.ShardState.ACTIVE:
            self.journal.record(ev.ShardSynced(pipeline=pid, rank=rank, version=ack.weight_version))
        if adapters and ack.state == m.ShardState.ACTIVE:
            for member, version in sorted(ack.adapter_versions.items()):
                if held.get(member) != version:
                    self.journal.record(
                        ev.ShardSynced(pipeline=pid, rank=rank, version=version, adapter=member)
                    )
        # Acknowledgements come back in bursts: what the caller does with this one
        # waits its turn. (What it says was recorded above, at once: a rank given up
        # meanwhile must not get a version back afterwards.)
        await self.pacer.turn()
        return ack

    def _adapters(self, pid: str) -> dict[str, CacheRef]:
        """A base group's members' newest adapters (empty for any other pipeline)."""
        p = self.registry.pipelines.get(pid)
        if p is None or not p.members:
            return {}
        return {
            member: self.shards.weights[member]
            for member in p.members
            if member in self.shards.weights
        }

    async def notify_ranks(self, pid: str) -> None:
        """Tell ``pid``'s driver which shards serve it now; for a base group, every
        member's driver (the group has none)."""
        await self.pacer.turn()
        p = self.registry.pipelines.get(pid)
        if p is None:
            return
        drivers = [self.registry.pipelines[q] for q in p.members] if p.members else [p]
        serving = self._serving(p)
        sid = serving.id
        endpoints = {
            r: self.shards.endpoints[(sid, r)]
            for r in serving.active
            if (sid, r) in self.shards.endpoints
        }
        data_keys = {
            r: self.shards.data_keys[(sid, r)]
            for r in serving.active
            if (sid, r) in self.shards.data_keys
        }
        ranks = m.ActiveRanks(
            cluster=INFER, ranks=sorted(serving.active), endpoints=endpoints, data_keys=data_keys
        )
        for q in drivers:
            if q.connected:
                await self.server.notify(m.driver_identity(q.id), ranks)
