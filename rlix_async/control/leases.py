"""Peers and leases: which workers and drivers are connected, and what their
coming and going does to the plan.

A shard worker is checked against its rank's devices at hello, its incarnation is
journaled, and a lost one leaves the plan fenced until a replacement says hello. A
driver that goes silent keeps its leases for ``lease_timeout_s``; after a restart,
ranks the journal says are awake whose worker never returns are fenced. Dropping a
pipeline reaps everything keyed by it.

:class:`LeaseKeeper` is one part of the coordinator
(:class:`~rlix_async.control.coordinator.Coordinator` holds it, and wires its
``admit_peer``, ``peer_joined`` and ``peer_lost`` to the server); what the coming
and going changes in the plan it has the
:class:`~rlix_async.control.plan_execution.PlanExecutor` carry out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from rlix_async.config import SchedulerConfig
from rlix_async.control import journal as ev
from rlix_async.control.journal import Journal
from rlix_async.control.plan_execution import PlanExecutor, devices_of, log
from rlix_async.control.registry import Registry, RegistryError
from rlix_async.protocols import messages as m
from rlix_async.protocols.topology import INFER, ClusterName, Priority
from rlix_async.security import Principal
from rlix_async.transport import PeerInfo, RpcServer


class LeaseKeeper:
    """Workers and drivers coming and going (see the module docstring)."""

    def __init__(
        self,
        server: RpcServer,
        registry: Registry,
        journal: Callable[[], Journal],
        cfg: SchedulerConfig,
        executor: PlanExecutor,
        kick: Callable[[], None],
    ) -> None:
        self.server = server
        self.registry = registry
        self._journal = journal
        self.cfg = cfg
        self.executor = executor
        self.kick = kick
        # pipeline -> (its key's max_hold_s, the key described): set at register/resume
        self.hold_limits: dict[str, tuple[float, str]] = {}
        self._held_since: dict[tuple[str, ClusterName, int], float] = {}  # by grant

    @property
    def journal(self) -> Journal:
        return self._journal()

    def admit_peer(self, identity: str, info: dict[str, object]) -> None:
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

    def check_bound_workers(self, pid: str) -> None:
        """Shard workers usually say hello before their pipeline registers, when their
        devices cannot be checked yet: check them now. A misbound one is disconnected
        (its hello is refused from now on) and its rank never started."""
        p = self.registry.pipelines[pid]
        prefix = m.worker_identity(pid, 0)[:-1]  # "<pid>/infer/": no parse of every peer
        for ident, info in list(self.server.peers.items()):
            if not ident.startswith(prefix) or (shard := m.shard_rank(ident)) is None:
                continue
            try:
                self.admit_peer(ident, info.info)
            except RegistryError as exc:
                log.error("%s; rank %s will not be started", exc.detail, shard[1])
                p.offline.add(shard[1])
                self.server.drop_peer(ident)

    def peer_joined(self, info: PeerInfo) -> None:
        shard = m.shard_rank(info.identity)
        if shard is not None:
            pid, rank = shard
            p = self.registry.pipelines.get(pid)
            incarnation = f"{info.host}:{info.pid}"
            if self.registry.workers.get((pid, rank)) != incarnation:
                self.journal.record(
                    ev.ShardJoined(pipeline=pid, rank=rank, incarnation=incarnation)
                )
                self.executor.failures.pop((pid, rank), None)  # a new worker starts afresh
            lifted = self.registry.worker_joined(pid, rank, incarnation)
            if lifted is not None:
                log.warning(
                    "%s: a new worker (%s) replaced %s: fence on devices %s lifted",
                    info.identity,
                    incarnation,
                    lifted.holder,
                    list(lifted.devices),
                )
                self.executor.journal_fences()
            elif (pid, rank) in self.registry.fences:
                # the same process is back (a blip): it must confirm its sleep
                self.executor.tasks.spawn(self.executor.sleep_rank(pid, rank), "sleep-rejoined")
            if info.info.get("data_endpoint"):
                self.executor.shards.endpoints[(pid, rank)] = str(info.info["data_endpoint"])
            if info.info.get("data_key"):
                self.executor.shards.data_keys[(pid, rank)] = str(info.info["data_key"])
            if p is not None and rank in p.offline:
                p.offline.discard(rank)  # back: it may be started again
                self.kick()
            if p is not None and rank in p.active:
                # its rank was already awake in the plan (it started late, or we
                # restarted): make the worker match; wake is idempotent
                self.executor.tasks.spawn(self.executor.expand_joined(pid, rank), "wake-joined")
        driver_of = m.driver_pipeline(info.identity)
        if driver_of is not None and (d := self.registry.pipelines.get(driver_of)) is not None:
            d.connected, d.lost_at = True, None

    def peer_lost(self, info: PeerInfo) -> None:
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
                self.executor.give_up_rank(pid, rank, "worker lost")
            f = self.registry.fences.get((pid, rank))
            if f is not None and not f.reason.startswith("worker lost"):
                f.reason = f"worker lost ({f.reason})"
            self.executor.shards.worker_gone((pid, rank))
            return
        driver_of = m.driver_pipeline(info.identity)
        if driver_of is not None and (d := self.registry.pipelines.get(driver_of)) is not None:
            d.connected, d.lost_at = False, time.monotonic()
            log.warning(
                "driver of %s lost; its leases expire in %.1fs unless it returns",
                driver_of,
                self.cfg.lease_timeout_s,
            )

    async def lease_loop(self) -> None:
        while True:  # until the coordinator's supervisor cancels it
            await asyncio.sleep(min(0.5, self.cfg.lease_timeout_s / 4))
            now = time.monotonic()
            for p in list(self.registry.pipelines.values()):
                if p.lost_at is not None and now - p.lost_at > self.cfg.lease_timeout_s:
                    self.drop_pipeline(p.id, "lease expired")
            self.check_holds(now)
            # a long-lived coordinator's journal is folded into one snapshot now and
            # then, so a restart never replays its whole history
            self.journal.maybe_compact(self.registry)

    def limit_holds(self, pid: str, principal: Principal | None) -> None:
        """Bound how long ``pid`` may hold a non-preemptable stage: its key's max_hold."""
        if principal is not None and principal.role == "admin":
            return  # an admin acting for the pipeline leaves its driver key's bound
        allow = principal.allowance if principal is not None else None
        if principal is not None and allow is not None and allow.max_hold_s is not None:
            self.hold_limits[pid] = (allow.max_hold_s, principal.describe())
        else:
            self.hold_limits.pop(pid, None)

    def check_holds(self, now: float) -> None:
        """Drop a pipeline that held a non-preemptable stage past its key's max_hold (a
        key holder could otherwise keep the devices forever). Timed from when this loop
        first saw the stage held: after a coordinator restart, from the restart."""
        held = {
            (p.id, cluster, p.grant_ids.get(cluster, 0))
            for p in self.registry.pipelines.values()
            for cluster, priority in p.held.items()
            if priority != Priority.GENERATION
        }
        self._held_since = {k: self._held_since.get(k, now) for k in held}
        for (pid, cluster, _), since in list(self._held_since.items()):
            limit = self.hold_limits.get(pid)
            if limit is not None and now - since > limit[0]:
                self.drop_pipeline(
                    pid,
                    f"held {cluster} for {now - since:.1f} s, over {limit[1]}'s "
                    f"max_hold {limit[0]:g} s",
                )

    def drop_pipeline(self, pid: str, reason: str) -> None:
        """Drop a pipeline: its stages released, its shards put to sleep (fenced until
        they confirm), everything keyed by it forgotten. A base group's last member
        takes the group with it, and the group's shards likewise."""
        before = self.registry.pipelines.get(pid)
        base = self.registry.pipelines.get(before.group) if before and before.group else None
        p = self.registry.remove(pid, fence=True)
        self.hold_limits.pop(pid, None)
        if p is None:
            return
        dropped = [p] if base is None or base.id in self.registry.pipelines else [p, base]
        for q in dropped:
            self.executor.shards.forget(q.id, self._connected)
        if base is not None:  # a member's adapter versions on the group's shards
            for held in self.executor.shards.adapters.values():
                held.pop(pid, None)
        log.warning(
            "pipeline %s dropped (%s): releasing %s and %d rollout ranks",
            pid,
            reason,
            sorted(p.held),
            sum(len(q.active) for q in dropped),
        )
        for cluster in p.held:
            self.journal.record(ev.Released(pipeline=pid, cluster=cluster))
        for q in dropped:
            if q.active:
                self.journal.record(
                    ev.Shrunk(
                        pipeline=q.id,
                        cluster=INFER,
                        ranks=sorted(q.active),
                        devices=devices_of(q.clusters[INFER], q.active),
                    )
                )
            for r in q.active:  # put its shards to sleep: fenced until they confirm
                self.executor.tasks.spawn(self.executor.sleep_rank(q.id, r), "sleep-dropped")
        self.journal.record(ev.Unregistered(pipeline=pid, reason=reason))
        self.executor.journal_fences()
        self.kick()

    def _connected(self, key: tuple[str, int]) -> bool:
        return m.worker_identity(*key) in self.server.peers

    def check_group_workers(self, pid: str, group: str | None) -> None:
        """A base group's shard workers serve the members they were started with: a
        pipeline joining a group whose connected workers do not list it is refused."""
        if group is None:
            return
        prefix = m.worker_identity(group, 0)[:-1]
        for ident, info in self.server.peers.items():
            members = info.info.get("members")
            if ident.startswith(prefix) and isinstance(members, list) and pid not in members:
                raise RegistryError(
                    "bad_group",
                    f"pipeline {pid}: the shards of base group {group} serve {members} only",
                )

    async def expire_phantom_ranks(self) -> None:
        """Ranks the journal says are awake, whose worker has not said hello within
        ``lease_timeout_s`` of the restart, leave the plan fenced (the worker may be
        alive and holding memory; it is lifted when a worker for the rank returns)."""
        await asyncio.sleep(self.cfg.lease_timeout_s)
        for p in list(self.registry.pipelines.values()):
            for rank in sorted(p.active):
                if m.worker_identity(p.id, rank) in self.server.peers:
                    continue
                if self.registry.workers.get((p.id, rank)) is None:
                    continue  # driver-run engines: no worker is expected
                log.warning(
                    "%s rank %d: awake in the journal, but its worker never came back "
                    "within %.0fs of the restart: fenced",
                    p.id,
                    rank,
                    self.cfg.lease_timeout_s,
                )
                p.offline.add(rank)
                self.executor.give_up_rank(p.id, rank, "worker never returned after a restart")
