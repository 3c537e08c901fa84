"""The fencing rule as a property: over random sequences of plans, sleeps that succeed
or fail, workers that die, go silent, come back or are replaced, and pipelines that are
dropped, no device is ever handed to anyone while a worker process may still hold it.

The registry and planner are the coordinator's own; the world around them (which
process holds memory on which device) is modelled here, and the coordinator's
reactions (rlix_async/control/plan_execution.py, leases.py and coordinator.py) are mirrored call for
call: ``apply(plan, fence=True)``, ``confirm_asleep`` after a sleep acknowledged by
the holder, ``worker_joined`` at every hello, ``remove(fence=True)`` on a drop,
``fences.covering`` before a grant or wake is delivered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from rlix_async.control.plan_checks import check_plan
from rlix_async.control.planner import plan
from rlix_async.control.registry import Registry
from rlix_async.protocols.snapshot import Plan, RankChange
from rlix_async.protocols.topology import INFER, TRAIN, ClusterShape, ClusterSpec, Priority

PIPES = {
    "a": {TRAIN: ClusterSpec(1, (0, 1)), INFER: ClusterSpec(1, (0, 1, 2, 3))},
    "b": {TRAIN: ClusterSpec(1, (2, 3)), INFER: ClusterSpec(2, (0, 1, 2, 3))},
}


@dataclass
class Worker:
    incarnation: int
    alive: bool = True  # the process exists (it may hold device memory)
    connected: bool = True  # the coordinator hears its heartbeats
    holds: set[int] = field(default_factory=set)  # devices it holds memory on

    @property
    def name(self) -> str:
        return f"host:{self.incarnation}"


@dataclass
class World:
    registry: Registry
    workers: dict[tuple[str, int], Worker] = field(default_factory=dict)
    pending: list[tuple[str, str, int | None, list[int]]] = field(default_factory=list)
    next_incarnation: int = 1

    def holders(self, device: int, besides: tuple[str, int] | None = None) -> list[str]:
        return [
            f"{k}:{w.name}"
            for k, w in self.workers.items()
            if w.alive and device in w.holds and k != besides
        ]

    # --- the coordinator's reactions, mirrored ------------------------------------------------

    def start_worker(self, pid: str, rank: int) -> None:
        """A supervisor starts a worker only after reaping its predecessor."""
        old = self.workers.get((pid, rank))
        if old is not None:
            old.alive = old.connected = False
            old.holds.clear()  # reaped: the OS freed its memory
        w = Worker(self.next_incarnation)  # engines sleep before hello: hold nothing
        self.next_incarnation += 1
        self.workers[(pid, rank)] = w
        self.registry.worker_joined(pid, rank, w.name)

    def schedule(self) -> None:
        snap = self.registry.snapshot(now=0.0)
        result = plan(snap)
        assert check_plan(snap, result) == []
        self.registry.apply(result, fence=True)
        for g in result.grants:
            self.pending.append(("grant", g.pipeline, None, g.devices))
        for ch in result.expand:
            spec = self.registry.pipelines[ch.pipeline].clusters[INFER]
            for r in ch.ranks:
                self.pending.append(("wake", ch.pipeline, r, list(spec.bundle(r))))

    def deliver(self) -> None:
        """Grants and wakes go out only when no fence covers their devices."""
        waiting = []
        for kind, pid, rank, devices in self.pending:
            p = self.registry.pipelines.get(pid)
            if p is None or (kind == "wake" and rank not in p.active):
                continue  # withdrawn meanwhile
            if self.registry.fences.covering(devices):
                waiting.append((kind, pid, rank, devices))
                continue
            besides = (pid, rank) if kind == "wake" else None
            for d in devices:
                assert not self.holders(d, besides), (
                    f"{kind} of {devices} to {pid} while {self.holders(d, besides)} hold {d}"
                )
            if kind == "wake":
                assert rank is not None
                w = self.workers.get((pid, rank))
                if w is not None and w.connected:
                    w.holds |= set(devices)
                elif w is not None:  # the wake command fails: give the rank up, fenced
                    self.give_up(pid, rank, "wake failed")
        self.pending = waiting

    def give_up(self, pid: str, rank: int, why: str) -> None:
        p = self.registry.pipelines.get(pid)
        if p is None or rank not in p.active:
            return
        self.registry.apply(Plan(shrink=[RankChange(pid, INFER, [rank])]))
        self.registry.fence(pid, rank, p.clusters[INFER].bundle(rank), why)

    def sleep(self, pid: str, rank: int, succeeds: bool) -> None:
        """One sleep command to a fenced rank's worker, acknowledged or not."""
        if (pid, rank) not in self.registry.fences:
            return
        w = self.workers.get((pid, rank))
        if w is None:  # no worker ever ran it
            self.registry.confirm_asleep(pid, rank, None)
            return
        if not w.connected:
            return  # the command cannot reach it
        if succeeds:
            w.holds.clear()
            self.registry.confirm_asleep(pid, rank, w.name)

    def lose(self, pid: str, rank: int, dies: bool) -> None:
        """Heartbeats stop: the process died, or is alive but silent (still holding)."""
        w = self.workers.get((pid, rank))
        if w is None or not w.connected:
            return
        w.connected = False
        if dies:
            w.alive = False
            w.holds.clear()
        p = self.registry.pipelines.get(pid)
        if p is not None:
            p.offline.add(rank)
            self.give_up(pid, rank, "worker lost")

    def rejoin(self, pid: str, rank: int) -> None:
        """A silent worker's heartbeats come back: the same incarnation says hello."""
        w = self.workers.get((pid, rank))
        if w is None or w.connected or not w.alive:
            return
        w.connected = True
        self.registry.worker_joined(pid, rank, w.name)
        p = self.registry.pipelines.get(pid)
        if p is not None:
            p.offline.discard(rank)

    def check_invariant(self) -> None:
        """A device a live process holds is fenced, or awake for that very worker."""
        owners = self.registry.owners()
        fenced = self.registry.fences.devices()
        for (pid, rank), w in self.workers.items():
            if not w.alive:
                continue
            for d in w.holds:
                o = owners[d]
                mine = o is not None and (o.pipeline, o.rank) == (pid, rank)
                assert d in fenced or mine, f"{pid}[{rank}] ({w.name}) holds {d}, owner {o}"
        # the snapshot's shortcut (Registry.unowned) agrees with the per-device owners
        for devices in (fenced, set(range(len(owners)))):
            free = {d for d in devices if owners[d] is None}
            assert self.registry.unowned(devices) == free, devices


# Weighted towards the steps that move devices between holders (plans and deliveries).
OP_NAMES = [
    *["progress", "train", "release"] * 2,
    *["schedule", "deliver"] * 4,
    *["sleep_ok", "sleep_fail", "die", "silent", "rejoin", "restart", "drop"],
]
OPS = st.lists(
    st.tuples(st.sampled_from(OP_NAMES), st.sampled_from(sorted(PIPES)), st.integers(0, 3)),
    min_size=20,
    max_size=80,
)


@settings(max_examples=400, deadline=None)
@given(OPS)
def test_no_device_is_handed_on_while_a_worker_may_hold_it(ops: list) -> None:  # type: ignore[type-arg]
    world = World(Registry(ClusterShape(nodes=1, gpus_per_node=4)))
    for pid, clusters in PIPES.items():
        world.registry.register(pid, dict(clusters))
        world.registry.admit(pid)
        for r in range(clusters[INFER].dp):
            world.start_worker(pid, r)
    for op, pid, n in ops:
        p = world.registry.pipelines.get(pid)
        rank = n % PIPES[pid][INFER].dp
        if op == "progress" and p is not None:
            world.registry.report_progress(pid, "default", 8, 8 - 2 * n)
        elif op == "train" and p is not None and TRAIN not in p.held and TRAIN not in p.requests:
            world.registry.request(pid, TRAIN, Priority.ACTOR_TRAINING, None, now=0.0)
        elif op == "release" and p is not None and TRAIN in p.held:
            if not any(k == "grant" and q == pid for k, q, _, _ in world.pending):
                world.registry.release(pid, TRAIN)  # only a delivered grant is released
        elif op == "schedule":
            world.schedule()
        elif op == "deliver":
            world.deliver()
        elif op in ("sleep_ok", "sleep_fail"):
            world.sleep(pid, rank, op == "sleep_ok")
        elif op in ("die", "silent"):
            world.lose(pid, rank, dies=op == "die")
        elif op == "rejoin":
            world.rejoin(pid, rank)
        elif op == "restart":
            world.start_worker(pid, rank)
        elif op == "drop" and p is not None:
            world.registry.remove(pid, fence=True)
        world.check_invariant()
    world.deliver()
    world.check_invariant()


def test_the_rules_the_property_leans_on() -> None:
    """Spelled out once: a silent worker's fence survives its own hello and is lifted by
    a new incarnation's; only the holder's confirmation lifts it otherwise."""
    reg = Registry(ClusterShape(nodes=1, gpus_per_node=4))
    reg.register("a", dict(PIPES["a"]))
    reg.worker_joined("a", 0, "h:1")
    reg.fence("a", 0, (0,), "sleeping")
    assert reg.confirm_asleep("a", 0, "h:2") is None  # not the holder
    assert reg.confirm_asleep("a", 0, None) is None  # a worker ran it: it must confirm
    assert reg.worker_joined("a", 0, "h:1") is None and (("a", 0) in reg.fences)
    assert reg.snapshot().fenced == [0]
    assert reg.worker_joined("a", 0, "h:2") is not None  # replaced: the old one is gone
    assert reg.fences == {} and reg.snapshot().fenced == []
