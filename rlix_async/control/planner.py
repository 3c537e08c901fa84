"""The planner: a pure function from a cluster snapshot to a plan.

``plan(snapshot)`` decides, in this order:

1. Gang requests (every priority but GENERATION), served by priority then
   arrival (``seq``). A request takes its cluster's whole device list or nothing.
   Generation shards on those devices are shrunk for it; devices held by another
   non-generation stage are waited for. A blocked request *reserves* its
   devices: later requests in the order cannot take them, and no new generation
   shard is started on them, so a big request is never starved by a stream of
   smaller ones. A request that has waited longer than ``policy.aging_s`` moves
   ahead of every fresh request (still never preempting a non-generation stage).
2. Generation gets what is left. Each pipeline's demand is its remaining
   trajectories (``target - min(completed, target)`` summed over streams), or the
   ``step_target_estimate`` of its pending GENERATION request when it reported no
   progress yet. Devices are divided in proportion to ``demand x tp``
   (water-filling, capped by the devices each pipeline can reach); every
   pipeline with demand gets at least one bundle when one is free.
3. Hysteresis: moving a shard costs a sleep, a wake and a weight sync, so a
   pipeline whose current share is within one bundle of its ideal keeps it, and
   shards of a pipeline without demand are only shrunk when another pipeline
   with unmet demand could use their devices.

:func:`check_plan` re-derives the resulting ownership and lists every broken
invariant; the coordinator never applies a plan with violations.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from rlix_async.control.snapshot import (
    Grant,
    PipelineIn,
    Plan,
    RankChange,
    RequestIn,
    Snapshot,
    Waiting,
)
from rlix_async.control.topology import INFER, ClusterShape, ClusterSpec, Priority

# --- planning ----------------------------------------------------------------------------

FENCED = ("", "fenced")  # the owner of a fenced device (no pipeline)


@dataclass
class _State:
    shape: ClusterShape
    pipes: dict[str, PipelineIn]
    owner: dict[int, tuple[str, str]] = field(default_factory=dict)  # non-generation holders
    active: dict[str, set[int]] = field(default_factory=dict)  # generation ranks awake
    reserved: dict[int, str] = field(default_factory=dict)  # device -> blocked request
    shrunk: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))

    def gen_holder(self) -> dict[int, tuple[str, int]]:
        out: dict[int, tuple[str, int]] = {}
        for pid, ranks in self.active.items():
            spec = self.pipes[pid].clusters[INFER]
            for r in ranks:
                for d in spec.bundle(r):
                    out[d] = (pid, r)
        return out

    def shrink(self, pid: str, rank: int) -> None:
        self.active[pid].discard(rank)
        self.shrunk[pid].add(rank)


def plan(snap: Snapshot) -> Plan:
    """Decide grants, shrinks and expands for one snapshot. Pure and deterministic."""
    st = _State(snap.cluster, {p.id: p for p in snap.pipelines})
    for d in snap.fenced:  # a shard may still hold it: as good as held by a stage
        st.owner[d] = FENCED
    for p in snap.pipelines:
        for cname in p.held:
            for d in p.clusters[cname].devices:
                st.owner[d] = (p.id, cname)
        st.active[p.id] = set(p.active_ranks.get(INFER, ()))
    out = Plan()
    _serve_gang_requests(snap, st, out)
    _allocate_generation(snap, st, out)
    out.shrink = [
        RankChange(pid, INFER, sorted(ranks)) for pid, ranks in sorted(st.shrunk.items()) if ranks
    ]
    busy = set(st.owner) | set(st.gen_holder())
    out.idle_devices = [d for d in range(snap.cluster.num_devices) if d not in busy]
    return out


def _gang_order(snap: Snapshot) -> list[tuple[PipelineIn, RequestIn]]:
    reqs = [(p, r) for p in snap.pipelines for r in p.requests if r.priority != "GENERATION"]
    aging = snap.policy.aging_s
    return sorted(reqs, key=lambda pr: (pr[1].age_s < aging, Priority[pr[1].priority], pr[1].seq))


def _serve_gang_requests(snap: Snapshot, st: _State, out: Plan) -> None:
    gen = st.gen_holder()
    for p, r in _gang_order(snap):
        devices = p.clusters[r.cluster].devices
        holders = sorted({st.owner[d] for d in devices if d in st.owner})
        reservers = sorted({st.reserved[d] for d in devices if d in st.reserved})
        if holders or reservers:
            if holders:
                held = [d for d in devices if d in st.owner]
                names = ", ".join(
                    f"{a}/{b}" if a else "a fence (sleep unconfirmed)" for a, b in holders
                )
                reason = f"devices {','.join(map(str, held))} held by {names}"
            else:
                reason = f"devices reserved for earlier request {', '.join(reservers)}"
            out.waiting.append(Waiting(p.id, r.cluster, reason))
            for d in devices:
                st.reserved.setdefault(d, f"{p.id}/{r.cluster}")
            continue
        for d in devices:
            if d in gen:
                pid, rank = gen.pop(d)
                if rank in st.active[pid]:
                    st.shrink(pid, rank)
            st.owner[d] = (p.id, r.cluster)
        out.grants.append(Grant(p.id, r.cluster, r.priority, list(devices)))


def _demand(p: PipelineIn) -> int:
    remaining = p.remaining()
    if remaining is not None:
        return remaining
    for r in p.requests:
        if r.priority == "GENERATION" and r.step_target_estimate:
            return r.step_target_estimate
    return 0


def water_fill(
    capacity: float,
    weights: dict[str, float],
    caps: dict[str, float],
    floors: dict[str, float] | None = None,
) -> dict[str, float]:
    """Split ``capacity`` in proportion to ``weights``, each share clamped to
    ``[floor, cap]``: share = clamp(lam * weight), with lam found by bisection."""
    floors = floors or {}
    keys = [k for k, w in weights.items() if w > 0 and caps[k] > 0]
    lo_of = {k: min(floors.get(k, 0.0), caps[k]) for k in keys}

    def total(lam: float) -> float:
        return sum(min(caps[k], max(lo_of[k], lam * weights[k])) for k in keys)

    share = dict.fromkeys(weights, 0.0)
    if not keys:
        return share
    if total(0.0) >= capacity:  # the floors alone use everything
        for k in keys:
            share[k] = lo_of[k]
        return share
    hi = 1.0
    while total(hi) < capacity and hi < 1e18:
        hi *= 2
    lo = 0.0
    for _ in range(80):
        mid = (lo + hi) / 2
        if total(mid) < capacity:
            lo = mid
        else:
            hi = mid
    for k in keys:
        share[k] = min(caps[k], max(lo_of[k], hi * weights[k]))
    return share


def guaranteed_floors(
    capacity: int,
    wanting: list[str],
    weights: dict[str, float],
    tp: dict[str, int],
    caps: dict[str, float],
) -> dict[str, float]:
    """One bundle for every pipeline with demand, largest demand first, while it fits."""
    floors: dict[str, float] = {}
    left = capacity
    for pid in sorted(wanting, key=lambda q: (-weights[q], q)):
        if tp[pid] <= left and caps[pid] >= tp[pid]:
            floors[pid] = tp[pid]
            left -= tp[pid]
    return floors


def _allocate_generation(snap: Snapshot, st: _State, out: Plan) -> None:
    pipes = [p for p in snap.pipelines if INFER in p.clusters]
    spec = {p.id: p.clusters[INFER] for p in pipes}
    offline = {p.id: set(p.offline_ranks.get(INFER, ())) for p in pipes}

    def reachable(pid: str, rank: int) -> bool:
        """A bundle this pipeline may run on: not held by a stage, not reserved
        (unless the shard already runs there)."""
        bundle = spec[pid].bundle(rank)
        if any(d in st.owner for d in bundle) or rank in offline[pid]:
            return False
        return rank in st.active[pid] or not any(d in st.reserved for d in bundle)

    demand = {p.id: _demand(p) for p in pipes}
    wanting = [p.id for p in pipes if demand[p.id] > 0]
    caps: dict[str, float] = {
        pid: sum(spec[pid].tp for r in range(spec[pid].dp) if reachable(pid, r)) for pid in wanting
    }
    usable: set[int] = set()
    for pid in wanting:
        for r in range(spec[pid].dp):
            if reachable(pid, r):
                usable.update(spec[pid].bundle(r))
    weights = {pid: float(demand[pid] * spec[pid].tp) for pid in wanting}
    tps = {pid: spec[pid].tp for pid in wanting}
    floors = guaranteed_floors(len(usable), wanting, weights, tps, caps)
    ideal = water_fill(len(usable), weights, caps, floors)
    # Free for the taking: unowned devices and shards of pipelines with nothing to generate.
    busy_gen = {d for d, (pid, _) in st.gen_holder().items() if demand.get(pid, 0) > 0}
    idle = len(usable - set(st.owner) - busy_gen)
    target = _bundle_targets(wanting, ideal, spec, st, caps, len(usable), idle)

    # Devices each under-target pipeline could use: shrink others there first.
    hungry = [pid for pid in wanting if len(st.active[pid]) < target[pid]]
    hungry_devices: dict[int, int] = defaultdict(int)
    for pid in hungry:
        for r in range(spec[pid].dp):
            if reachable(pid, r) and r not in st.active[pid]:
                for d in spec[pid].bundle(r):
                    hungry_devices[d] += 1

    def contention(pid: str, rank: int) -> tuple[int, int]:
        return (-sum(hungry_devices.get(d, 0) for d in spec[pid].bundle(rank)), -rank)

    for p in pipes:
        pid = p.id
        ranks = st.active[pid]
        if demand[pid] == 0:
            for r in sorted(ranks):
                if any(hungry_devices.get(d) for d in spec[pid].bundle(r)):
                    st.shrink(pid, r)
            continue
        excess = len(ranks) - target[pid]
        for r in sorted(ranks, key=lambda r: contention(pid, r))[: max(excess, 0)]:
            st.shrink(pid, r)

    taken = set(st.owner) | set(st.gen_holder())
    expands: dict[str, list[int]] = defaultdict(list)
    # Neediest first: the largest gap between target and current share.
    for pid in sorted(hungry, key=lambda q: (len(st.active[q]) / max(target[q], 1), q)):
        free = [
            r
            for r in range(spec[pid].dp)
            if r not in st.active[pid]
            and reachable(pid, r)
            and not any(d in taken or d in st.reserved for d in spec[pid].bundle(r))
        ]
        # Prefer bundles other hungry pipelines cannot use, then low ranks.
        free.sort(key=lambda r: (sum(hungry_devices.get(d, 0) for d in spec[pid].bundle(r)), r))
        for r in free[: max(target[pid] - len(st.active[pid]), 0)]:
            expands[pid].append(r)
            taken.update(spec[pid].bundle(r))
        st.active[pid].update(expands[pid])
    # A rank shrunk and expanded in the same plan is simply kept.
    for pid, expanded in expands.items():
        kept = set(expanded) & st.shrunk[pid]
        st.shrunk[pid] -= kept
        fresh = sorted(set(expanded) - kept)
        if fresh:
            out.expand.append(RankChange(pid, INFER, fresh))
    for pid in wanting:
        if not st.active[pid]:
            blocked = "every reachable bundle is held by a stage or reserved"
            out.waiting.append(Waiting(pid, INFER, f"generation: {blocked}"))


def _bundle_targets(
    wanting: list[str],
    ideal: dict[str, float],
    spec: dict[str, ClusterSpec],
    st: _State,
    caps: dict[str, float],
    capacity: int,
    idle: int,
) -> dict[str, int]:
    """Whole bundles per pipeline: largest remainder, at least one, then hysteresis.

    Hysteresis never leaves a device idle: a pipeline within one bundle of its
    ideal still grows by that bundle when ``idle`` devices (unowned, or held by a
    shard of a pipeline with nothing left to generate) can hold it.
    """
    exact = {pid: ideal[pid] / spec[pid].tp for pid in wanting}
    target = {pid: int(exact[pid]) for pid in wanting}
    room = capacity - sum(target[pid] * spec[pid].tp for pid in wanting)
    for pid in sorted(wanting, key=lambda q: (-(exact[q] - target[q]), q)):
        tp = spec[pid].tp
        if exact[pid] > target[pid] and room >= tp and (target[pid] + 1) * tp <= caps[pid]:
            target[pid] += 1
            room -= tp
    for pid in wanting:  # every pipeline with demand gets a bundle when it can reach one
        if target[pid] == 0 and caps[pid] >= spec[pid].tp:
            target[pid] = 1
    for pid in wanting:  # hysteresis: a current share within one bundle of ideal stays
        current = len(st.active[pid])
        if current and abs(current - exact[pid]) <= 1 and current * spec[pid].tp <= caps[pid]:
            if target[pid] > current and idle >= spec[pid].tp:
                target[pid] = current + 1
                idle -= spec[pid].tp
            else:
                target[pid] = current
    # Keep the total feasible: trim those furthest above their ideal (never below one).
    while sum(target[pid] * spec[pid].tp for pid in wanting) > capacity:
        over = [pid for pid in wanting if target[pid] > 1]
        if not over:
            break
        worst = max(over, key=lambda q: (target[q] - exact[q], q))
        target[worst] -= 1
    return target


# --- invariants ----------------------------------------------------------------------------


def check_plan(snap: Snapshot, result: Plan) -> list[str]:
    """Every broken invariant of applying ``result`` to ``snap`` (empty when sound)."""
    errors: list[str] = []
    pipes = {p.id: p for p in snap.pipelines}
    n = snap.cluster.num_devices
    owner: dict[int, str] = {}

    def claim(d: int, who: str) -> None:
        if not 0 <= d < n:
            errors.append(f"{who}: device {d} does not exist")
        elif d in owner:
            errors.append(f"device {d} double-booked: {owner[d]} and {who}")
        else:
            owner[d] = who

    for d in snap.fenced:
        claim(d, "a fence")
    for p in snap.pipelines:
        for cname in p.held:
            for d in p.clusters[cname].devices:
                claim(d, f"{p.id}/{cname}")
    active = {p.id: set(p.active_ranks.get(INFER, ())) for p in snap.pipelines}
    for ch in result.shrink:
        shrunk = pipes.get(ch.pipeline)
        if shrunk is None or ch.cluster != INFER:
            errors.append(f"shrink of unknown {ch.pipeline}/{ch.cluster}")
            continue
        for r in ch.ranks:
            if r not in active[shrunk.id]:
                errors.append(f"shrink of {shrunk.id} rank {r}, which is not active")
            active[shrunk.id].discard(r)
    pending = {(p.id, r.cluster): r for p in snap.pipelines for r in p.requests}
    for g in result.grants:
        req = pending.get((g.pipeline, g.cluster))
        if req is None or req.priority == "GENERATION":
            errors.append(f"grant {g.pipeline}/{g.cluster} answers no gang request")
            continue
        if g.priority != req.priority:
            errors.append(
                f"grant {g.pipeline}/{g.cluster} at {g.priority}, requested at {req.priority}"
            )
        if g.devices != list(pipes[g.pipeline].clusters[g.cluster].devices):
            errors.append(f"grant {g.pipeline}/{g.cluster} is not the whole device list")
        for d in g.devices:
            claim(d, f"{g.pipeline}/{g.cluster}")
    for ch in result.expand:
        grown = pipes.get(ch.pipeline)
        if grown is None or ch.cluster != INFER:
            errors.append(f"expand of unknown {ch.pipeline}/{ch.cluster}")
            continue
        for r in ch.ranks:
            if not 0 <= r < grown.clusters[INFER].dp:
                errors.append(f"expand of {grown.id} rank {r} out of range")
            elif r in active[grown.id]:
                errors.append(f"expand of {grown.id} rank {r}, which is already active")
            elif r in grown.offline_ranks.get(INFER, ()):
                errors.append(f"expand of {grown.id} rank {r}, which is offline")
            active[grown.id].add(r)
    for pid, ranks in active.items():
        spec = pipes[pid].clusters.get(INFER)
        for r in ranks:
            if spec is None or not 0 <= r < spec.dp:
                errors.append(f"{pid} rank {r} out of range")
                continue
            for d in spec.bundle(r):
                claim(d, f"{pid}/{INFER}[{r}]")
    idle = [d for d in range(n) if d not in owner]
    if sorted(result.idle_devices) != idle:
        errors.append(f"idle_devices {result.idle_devices} != unowned devices {idle}")
    return errors


def idle_after(snap: Snapshot, result: Plan) -> list[int]:
    """The devices nobody holds once ``result`` is applied to ``snap``: no fence, no
    stage held or granted, no awake rank (the plan's ``idle_devices``, derived)."""
    owned = set(snap.fenced)
    active = {p.id: set(p.active_ranks.get(INFER, ())) for p in snap.pipelines}
    for ch in result.shrink:
        active.get(ch.pipeline, set()).difference_update(ch.ranks)
    for ch in result.expand:
        active.setdefault(ch.pipeline, set()).update(ch.ranks)
    pipes = {p.id: p for p in snap.pipelines}
    for p in snap.pipelines:
        for cname in p.held:
            owned.update(p.clusters[cname].devices)
    for g in result.grants:
        owned.update(g.devices)
    for pid, ranks in active.items():
        spec = pipes[pid].clusters.get(INFER) if pid in pipes else None
        for r in ranks:
            if spec is not None and 0 <= r < spec.dp:
                owned.update(spec.bundle(r))
    return [d for d in range(snap.cluster.num_devices) if d not in owned]
