"""Carrying out a plan: the commands the coordinator sends to shard workers (sleep,
wake, sync) and the notifications its drivers get (grants, awake ranks).

Shrinks start at once; a grant or an expand waits only for the shrinks on its
own devices; every command has a timeout, and a shard that cannot wake or sync
gives its devices back. A part of :class:`~rlix_async.control.coordinator.Coordinator`
(which inherits it): the state it reads and writes is the coordinator's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from rlix_async.aio import Supervisor
from rlix_async.config import SchedulerConfig
from rlix_async.control import journal as ev
from rlix_async.control import messages as m
from rlix_async.control.journal import Journal
from rlix_async.control.registry import Registry
from rlix_async.control.snapshot import Plan, RankChange
from rlix_async.control.topology import INFER, ClusterName, ClusterSpec, PriorityName
from rlix_async.transport import RpcServer
from rlix_async.weights.ref import CacheRef

log = logging.getLogger("rlix_async.control.coordinator")


def devices_of(spec: ClusterSpec, ranks: Iterable[int]) -> list[int]:
    return sorted(d for r in ranks for d in spec.bundle(r))


class PlanRealiser:
    server: RpcServer
    registry: Registry
    journal: Journal
    cfg: SchedulerConfig
    tasks: Supervisor
    kick: Callable[[], None]
    weights: dict[str, CacheRef]  # latest promoted version per pipeline
    shard_versions: dict[tuple[str, int], int | None]  # acked by workers
    shard_endpoints: dict[tuple[str, int], str]  # data planes, for routers
    _freeing: dict[int, asyncio.Future[None]]  # device -> its shrink, until asleep

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

    def _rank_event(
        self, kind: type[ev.Shrunk] | type[ev.Expanded], ch: RankChange
    ) -> ev.Shrunk | ev.Expanded:
        spec = self._infer_spec(ch.pipeline)
        devices = devices_of(spec, ch.ranks) if spec else []
        return kind(pipeline=ch.pipeline, cluster=ch.cluster, ranks=ch.ranks, devices=devices)

    def _infer_spec(self, pid: str) -> ClusterSpec | None:
        p = self.registry.pipelines.get(pid)
        return p.clusters.get(INFER) if p else None

    async def _realise(self, result: Plan, answered: list[str]) -> None:
        """Shrinks now; each grant/expand waits only for shrinks on its own devices."""
        loop = asyncio.get_running_loop()
        shrinks = []
        for ch in result.shrink:
            spec = self._infer_spec(ch.pipeline)
            for r in ch.ranks:
                fut: asyncio.Future[None] = loop.create_future()
                for d in spec.bundle(r) if spec else ():
                    self._freeing[d] = fut
                shrinks.append(self.tasks.spawn(self._shrink_rank(ch.pipeline, r, fut), "shrink"))
        steps = [self._grant(g.pipeline, g.cluster, g.priority, g.devices) for g in result.grants]
        for ch in result.expand:
            spec = self._infer_spec(ch.pipeline)
            if spec is not None:
                steps.append(self._expand(ch.pipeline, ch.ranks, spec))
        await asyncio.gather(*shrinks, *steps, return_exceptions=True)
        for pid in {ch.pipeline for ch in result.shrink} | {ch.pipeline for ch in result.expand}:
            await self._notify_ranks(pid)
        for pid in answered:
            p = self.registry.pipelines.get(pid)
            if p is not None:
                await self.server.notify(
                    m.driver_identity(pid),
                    m.Granted(cluster=INFER, priority="GENERATION", ranks=sorted(p.active)),
                )

    async def _shrink_rank(self, pid: str, rank: int, done: asyncio.Future[None]) -> None:
        try:
            await self._command(pid, rank, "sleep")
        finally:
            done.set_result(None)

    async def _wait_devices_free(self, devices: list[int] | tuple[int, ...]) -> None:
        pending = {self._freeing[d] for d in devices if d in self._freeing}
        pending = {f for f in pending if not f.done()}
        if pending:
            _, late = await asyncio.wait(pending, timeout=self.cfg.command_timeout_s)
            if late:
                log.error(
                    "devices %s still not free after %.0fs; proceeding",
                    list(devices),
                    self.cfg.command_timeout_s,
                )

    async def _grant(
        self, pid: str, cluster: ClusterName, priority: PriorityName, devices: list[int]
    ) -> None:
        await self._wait_devices_free(devices)
        await self.server.notify(
            m.driver_identity(pid), m.Granted(cluster=cluster, priority=priority, devices=devices)
        )

    async def _expand(self, pid: str, ranks: list[int], spec: ClusterSpec) -> None:
        async def one(rank: int) -> None:
            await self._wait_devices_free(spec.bundle(rank))
            if not await self._command(pid, rank, "wake"):
                self._give_up_rank(pid, rank)

        await asyncio.gather(*(one(r) for r in ranks))

    async def _expand_joined(self, pid: str, rank: int) -> None:
        if not await self._command(pid, rank, "wake"):
            self._give_up_rank(pid, rank)
        await self._notify_ranks(pid)

    async def _sync_rank(self, pid: str, rank: int) -> None:
        if not await self._command(pid, rank, "sync"):
            self._give_up_rank(pid, rank)

    def _give_up_rank(self, pid: str, rank: int) -> None:
        """A shard that could not wake (or sync) is not serving: free its bundle."""
        p = self.registry.pipelines.get(pid)
        if p is None or rank not in p.active:
            return
        lost = Plan(shrink=[RankChange(pid, INFER, [rank])])
        self.registry.apply(lost)
        self._journal_plan(lost)
        self.shard_versions.pop((pid, rank), None)
        self.tasks.spawn(self._command(pid, rank, "sleep"), "sleep-failed")  # if still alive
        self.tasks.spawn(self._notify_ranks(pid), "ranks")
        self.kick()

    async def _command(self, pid: str, rank: int, action: m.ShardAction) -> bool:
        """Tell shard worker ``pid/infer/rank`` to sleep, wake or sync. Pipelines that
        run their engines themselves (no worker registered) follow ActiveRanks."""
        ident = m.worker_identity(pid, rank)
        if ident not in self.server.peers:
            return True
        weights = self.weights.get(pid) if action != "sleep" else None
        try:
            ack = await self.server.call(
                ident,
                m.ShardCommand(action=action, weights=weights),
                timeout=self.cfg.command_timeout_s,
            )
        except Exception as exc:  # the worker is stuck or gone: its devices move on anyway
            log.error("%s of %s failed: %s", action, ident, exc)
            return False
        if isinstance(ack, m.ShardAck):
            self.shard_versions[(pid, rank)] = ack.weight_version
            if weights is not None and ack.state == m.ShardState.ACTIVE:
                self.journal.record(
                    ev.ShardSynced(pipeline=pid, rank=rank, version=ack.weight_version)
                )
        return True

    async def _notify_ranks(self, pid: str) -> None:
        p = self.registry.pipelines.get(pid)
        if p is not None and p.connected:
            endpoints = {
                r: self.shard_endpoints[(pid, r)]
                for r in p.active
                if (pid, r) in self.shard_endpoints
            }
            await self.server.notify(
                m.driver_identity(pid),
                m.ActiveRanks(cluster=INFER, ranks=sorted(p.active), endpoints=endpoints),
            )
