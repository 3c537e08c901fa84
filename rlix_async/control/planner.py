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
   progress yet. Devices are divided in proportion to ``weight x demand x tp``
   (water-filling, capped by the devices each pipeline can reach; ``weight`` is
   the pipeline's fair-share weight, 1 by default); every pipeline with demand
   gets at least one bundle when one is free.
3. Hysteresis: moving a shard costs a sleep, a wake and a weight sync, so a
   pipeline whose current share is within one bundle of its ideal keeps it, and
   shards of a pipeline without demand are only shrunk when another pipeline
   with unmet demand could use their devices.

:func:`check_plan` re-derives the resulting ownership and lists every broken
invariant; the coordinator never applies a plan with violations.

Sets of devices are int bitmasks here (:mod:`rlix_async.control.planner_bits`),
so a plan over thousands of devices takes milliseconds; the water-filling is
:mod:`rlix_async.control.planner_fill`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import reduce
from itertools import chain
from operator import or_

from rlix_async.control.planner_bits import Counts, Devices, Frame
from rlix_async.control.planner_fill import water_fill
from rlix_async.control.snapshot import (
    Grant,
    PipelineIn,
    Plan,
    ProgressIn,
    RankChange,
    RequestIn,
    Snapshot,
    Waiting,
)
from rlix_async.control.topology import INFER, ClusterShape, ClusterSpec, Priority

# --- planning ----------------------------------------------------------------------------

FENCED = ("", "fenced")  # the owner of a fenced device (no pipeline)
_RANK = {p.name: p.value for p in Priority}  # Priority[name], as a plain lookup


@dataclass
class _State:
    shape: ClusterShape
    pipes: dict[str, PipelineIn]
    demand: dict[str, int] = field(default_factory=dict)  # per pipeline with generation
    owner: dict[int, tuple[str, str]] = field(default_factory=dict)  # non-generation holders
    active: dict[str, set[int]] = field(default_factory=dict)  # generation ranks awake
    reserved: list[tuple[int, str]] = field(default_factory=list)  # (devices, request), blocked
    shrunk: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    # The same as device masks (planner_bits): ``owned`` and ``blocked`` are the keys
    # of ``owner`` and of all ``reserved``; ``shards[pid]`` is pid's awake bundles in its
    # frame, kept in step with ``active`` by shrink(). Awake ranks out of range or
    # sharing a device (a snapshot that fails validation) make the state
    # ``irregular``: ``shards`` is then unused and gen_holder() answers instead.
    devices: Devices = field(init=False)
    owned: int = 0
    blocked: int = 0
    shards: dict[str, int] = field(default_factory=dict)
    indexed: dict[str, int] = field(default_factory=dict)  # shards' devices, before shrinks
    irregular: bool = False
    frames: dict[str, Frame] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.devices = Devices(self.shape.num_devices)

    def index_shards(self) -> None:
        seen = 0
        for pid, ranks in self.active.items():
            spec = self.pipes[pid].clusters[INFER]  # every pipeline has one (KeyError otherwise)
            if not ranks:
                continue
            frame = self.frames[pid] = Frame(spec, self.devices)
            if min(ranks) < 0 or max(ranks) >= frame.dp:
                self.irregular = True
                continue
            self.shards[pid] = frame.starts_of(ranks) * frame.block
            mask = self.indexed[pid] = frame.spread(self.shards[pid])
            if mask & seen or mask.bit_count() != len(ranks) * frame.tp:
                self.irregular = True
            seen |= mask

    def gen_holder(self) -> dict[int, tuple[str, int]]:
        """device -> the awake shard on it (the last one, where several are)."""
        out: dict[int, tuple[str, int]] = {}
        for pid, ranks in self.active.items():
            spec = self.pipes[pid].clusters[INFER]
            for r in ranks:
                for d in spec.bundle(r):
                    out[d] = (pid, r)
        return out

    def busy(self) -> int:
        """Devices held by a stage, fenced, or under an awake shard."""
        if self.irregular:
            return self.owned | self.devices.mask(self.gen_holder())
        return reduce(
            or_, [self.frames[pid].spread(x) for pid, x in self.shards.items()], self.owned
        )

    def shrink(self, pid: str, ranks: Collection[int]) -> None:
        self.active[pid].difference_update(ranks)
        self.shrunk[pid].update(ranks)
        if not self.irregular:
            frame = self.frames[pid]
            self.shards[pid] &= ~(frame.starts_of(ranks) * frame.block)


def plan(snap: Snapshot) -> Plan:
    """Decide grants, shrinks and expands for one snapshot. Pure and deterministic."""
    st = _State(snap.cluster, {p.id: p for p in snap.pipelines})
    for d in snap.fenced:  # a shard may still hold it: as good as held by a stage
        st.owner[d] = FENCED
    st.owned = st.devices.mask(snap.fenced)
    for p in snap.pipelines:
        if INFER in p.clusters:
            st.demand[p.id] = _demand(p)
        for cname in p.held:
            st.owner.update(dict.fromkeys(p.clusters[cname].devices, (p.id, cname)))
            st.owned |= st.devices.mask(p.clusters[cname].devices)
        st.active[p.id] = set(p.active_ranks.get(INFER, ()))
    st.index_shards()
    out = Plan()
    _serve_gang_requests(snap, st, out)
    busy = _allocate_generation(snap, st, out)
    out.shrink = [
        RankChange(pid, INFER, sorted(ranks)) for pid, ranks in sorted(st.shrunk.items()) if ranks
    ]
    out.idle_devices = st.devices.listed(~busy)
    return out


def _gang_order(snap: Snapshot) -> list[tuple[PipelineIn, RequestIn]]:
    reqs = [(p, r) for p in snap.pipelines for r in p.requests if r.priority != "GENERATION"]
    aging = snap.policy.aging_s
    return sorted(reqs, key=lambda pr: (pr[1].age_s < aging, _RANK[pr[1].priority], pr[1].seq))


def _serve_gang_requests(snap: Snapshot, st: _State, out: Plan) -> None:
    granted: list[tuple[int, ...]] = []
    granted_mask = 0
    for p, r in _gang_order(snap):
        devices = p.clusters[r.cluster].devices
        mask = st.devices.mask(devices)
        if mask & (st.owned | st.blocked):
            if mask & st.owned:
                held = [d for d in devices if d in st.owner]
                names = ", ".join(
                    f"{a}/{b}" if a else "a fence (sleep unconfirmed)"
                    for a, b in sorted({st.owner[d] for d in held})
                )
                reason = f"devices {','.join(map(str, held))} held by {names}"
            else:
                reason = f"devices reserved for earlier request {', '.join(_reservers(st, mask))}"
            out.waiting.append(Waiting(p.id, r.cluster, reason))
            st.reserved.append((mask, f"{p.id}/{r.cluster}"))
            st.blocked |= mask
            continue
        st.owner.update(dict.fromkeys(devices, (p.id, r.cluster)))
        st.owned |= mask
        out.grants.append(Grant(p.id, r.cluster, r.priority, list(devices)))
        granted.append(devices)
        granted_mask |= mask
    # Shards on granted devices are shrunk (after the loop: no decision above reads them).
    if st.irregular:
        gen = st.gen_holder()
        for d in chain.from_iterable(granted):
            shard = gen.pop(d, None)
            if shard is not None and shard[1] in st.active[shard[0]]:
                st.shrink(shard[0], [shard[1]])
        return
    for pid, shards in list(st.shards.items()):
        if st.indexed[pid] & granted_mask:
            frame = st.frames[pid]
            st.shrink(pid, frame.ranks(frame.touched(frame.local(granted_mask)) & shards))


def _reservers(st: _State, mask: int) -> list[str]:
    """The requests that reserved these devices first, sorted."""
    names = set()
    for reserved, name in st.reserved:
        if reserved & mask:
            names.add(name)
            mask &= ~reserved
    return sorted(names)


def _awake(st: _State, pid: str) -> int:
    """The starts of pid's awake ranks in ``range(dp)``."""
    frame = st.frames[pid]
    if st.irregular:
        return frame.ranks_in(st.active[pid])
    return st.shards.get(pid, 0) & frame.starts


def _demand(p: PipelineIn) -> int:
    progress = p.progress
    if type(progress) is ProgressIn:  # one stream: what remaining() returns, sooner
        return progress.target - min(progress.completed, progress.target)
    remaining = p.remaining()
    if remaining is not None:
        return remaining
    for r in p.requests:
        if r.priority == "GENERATION" and r.step_target_estimate:
            return r.step_target_estimate
    return 0


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


def _allocate_generation(snap: Snapshot, st: _State, out: Plan) -> int:
    """Shrinks and expands for generation; returns the devices busy afterwards
    (held by a stage, fenced, or under an awake shard) as a device mask."""
    pipes = [p for p in snap.pipelines if INFER in p.clusters]
    spec = {p.id: p.clusters[INFER] for p in pipes}
    offline = {p.id: p.offline_ranks.get(INFER, ()) for p in pipes}
    demand = st.demand
    wanting = [p.id for p in pipes if demand[p.id] > 0]
    for pid in wanting:
        if pid not in st.frames:
            st.frames[pid] = Frame(spec[pid], st.devices)
    # The bundles each pipeline may run on (as frame starts): no device held by a
    # stage, not offline, and no device reserved unless the shard already runs
    # there. Stages, fences and reservations are settled now; awake ranks still
    # change below, but only for pipelines with no demand or above their target,
    # never for one that grows.
    reach: dict[str, int] = {}
    usable = 0
    for pid in wanting:
        frame = st.frames[pid]
        ok = frame.starts & ~frame.touched(frame.local(st.owned))
        reserved = frame.local(st.blocked)
        if reserved:
            ok &= ~frame.touched(reserved) | _awake(st, pid)
        if offline[pid]:
            ok &= ~frame.ranks_in(offline[pid])
        reach[pid] = ok
        usable |= frame.spread(ok * frame.block)
    tps = {pid: spec[pid].tp for pid in wanting}
    caps: dict[str, float] = {pid: tps[pid] * reach[pid].bit_count() for pid in wanting}
    weight = {p.id: p.weight for p in pipes}
    weights = {pid: weight[pid] * demand[pid] * tps[pid] for pid in wanting}
    capacity = usable.bit_count()
    floors = guaranteed_floors(capacity, wanting, weights, tps, caps)
    ideal = water_fill(capacity, weights, caps, floors)
    # Free for the taking: unowned devices and shards of pipelines with nothing to generate.
    if st.irregular:
        gen = st.gen_holder()
        busy_gen = st.devices.mask([d for d, (pid, _) in gen.items() if demand.get(pid, 0) > 0])
    else:
        busy_gen = reduce(or_, [st.frames[q].spread(st.shards.get(q, 0)) for q in wanting], 0)
    idle = (usable & ~st.owned & ~busy_gen).bit_count()
    target = _bundle_targets(wanting, ideal, spec, st, caps, capacity, idle)

    # Devices each under-target pipeline could use: shrink others there first.
    hungry = [pid for pid in wanting if len(st.active[pid]) < target[pid]]
    asleep = {pid: reach[pid] & ~_awake(st, pid) for pid in hungry}
    hungry_devices = Counts()
    for pid in hungry:
        st.frames[pid].count(hungry_devices, asleep[pid])
    contended = hungry_devices.support()

    for p in pipes:
        pid = p.id
        ranks = st.active[pid]
        if not ranks:
            continue
        frame = st.frames[pid]
        if demand[pid] == 0:
            if not contended:
                continue
            if st.irregular:
                hit = [r for r in sorted(ranks) if frame.bundle(r) & contended]
            else:
                hit = frame.ranks(frame.touched(frame.local(contended)) & st.shards[pid])
            st.shrink(pid, hit)
            continue
        excess = len(ranks) - target[pid]
        if excess > 0:  # the most contended first, then high ranks
            load = frame.loads(hungry_devices, ranks)
            by_load = sorted(sorted(ranks, reverse=True), key=load.__getitem__, reverse=True)
            st.shrink(pid, by_load[:excess])

    taken = st.busy()
    expands: dict[str, list[int]] = defaultdict(list)
    # Neediest first: the largest gap between target and current share.
    for pid in sorted(hungry, key=lambda q: (len(st.active[q]) / max(target[q], 1), q)):
        frame = st.frames[pid]
        # Reachable and asleep (so not reserved), and not taken since.
        free = frame.ranks(asleep[pid] & ~frame.touched(frame.local(taken)))
        wanted = max(target[pid] - len(st.active[pid]), 0)
        if len(free) > wanted:  # prefer bundles other hungry pipelines cannot use, then low ranks
            free.sort(key=frame.loads(hungry_devices, free).__getitem__)
        chosen = free[:wanted]
        expands[pid] += chosen
        taken |= frame.spread(frame.starts_of(chosen) * frame.block)
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
    return taken


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
    tps = {pid: spec[pid].tp for pid in wanting}
    exact = {pid: ideal[pid] / tps[pid] for pid in wanting}
    target = {pid: int(exact[pid]) for pid in wanting}
    room = capacity - sum(target[pid] * tps[pid] for pid in wanting)
    for pid in sorted(wanting, key=lambda q: (-(exact[q] - target[q]), q)):
        tp = tps[pid]
        if exact[pid] > target[pid] and room >= tp and (target[pid] + 1) * tp <= caps[pid]:
            target[pid] += 1
            room -= tp
    for pid in wanting:  # every pipeline with demand gets a bundle when it can reach one
        if target[pid] == 0 and caps[pid] >= tps[pid]:
            target[pid] = 1
    for pid in wanting:  # hysteresis: a current share within one bundle of ideal stays
        current = len(st.active[pid])
        if current and abs(current - exact[pid]) <= 1 and current * tps[pid] <= caps[pid]:
            if target[pid] > current and idle >= tps[pid]:
                target[pid] = current + 1
                idle -= tps[pid]
            else:
                target[pid] = current
    # Keep the total feasible: trim those furthest above their ideal (never below one).
    total = sum(target[pid] * tps[pid] for pid in wanting)
    while total > capacity:
        over = [pid for pid in wanting if target[pid] > 1]
        if not over:
            break
        worst = max(over, key=lambda q: (target[q] - exact[q], q))
        target[worst] -= 1
        total -= tps[worst] * wanting.count(worst)  # once, unless pipeline ids repeat
    return target


# --- invariants ----------------------------------------------------------------------------


def check_plan(snap: Snapshot, result: Plan) -> list[str]:
    """Every broken invariant of applying ``result`` to ``snap`` (empty when sound)."""
    try:
        if _sound(snap, result):
            return []
    except (TypeError, ValueError, KeyError, IndexError, AttributeError):
        pass  # something odd: the itemised check decides (and raises as it does)
    return _violations(snap, result)


def _sound(snap: Snapshot, result: Plan) -> bool:
    """Whether :func:`_violations` finds nothing, decided with device masks: every
    claim (fence, held or granted stage, awake bundle) is counted, and the claims
    are disjoint and on existing devices exactly when their union has as many
    devices as there were claims, all below ``n``."""
    n = snap.cluster.num_devices
    devices = Devices(n)
    pipes = {p.id: p for p in snap.pipelines}
    claimed, claims = devices.mask(snap.fenced), len(snap.fenced)
    for p in snap.pipelines:
        for cname in p.held:
            claimed |= devices.mask(p.clusters[cname].devices)
            claims += len(p.clusters[cname].devices)
    active = {p.id: set(p.active_ranks.get(INFER, ())) for p in snap.pipelines}
    for ch in result.shrink:
        ranks = set(ch.ranks)
        if ch.pipeline not in pipes or ch.cluster != INFER or len(ranks) != len(ch.ranks):
            return False
        if not ranks <= active[ch.pipeline]:
            return False
        active[ch.pipeline] -= ranks
    pending = {(p.id, r.cluster): r for p in snap.pipelines for r in p.requests}
    for g in result.grants:
        req = pending.get((g.pipeline, g.cluster))
        if req is None or req.priority == "GENERATION" or g.priority != req.priority:
            return False
        if g.devices != list(pipes[g.pipeline].clusters[g.cluster].devices):
            return False
        claimed |= devices.mask(pipes[g.pipeline].clusters[g.cluster].devices)
        claims += len(g.devices)
    for ch in result.expand:
        ranks = set(ch.ranks)
        if ch.pipeline not in pipes or ch.cluster != INFER or len(ranks) != len(ch.ranks):
            return False
        grown = pipes[ch.pipeline]
        if ranks and not (min(ranks) >= 0 and max(ranks) < grown.clusters[INFER].dp):
            return False
        if not ranks.isdisjoint(active[grown.id]) or not ranks.isdisjoint(
            grown.offline_ranks.get(INFER, ())
        ):
            return False
        active[grown.id] |= ranks
    for pid, ranks in active.items():
        if not ranks:
            continue
        spec = pipes[pid].clusters.get(INFER)
        if spec is None or min(ranks) < 0 or max(ranks) >= spec.dp:
            return False
        claimed |= devices.bundles(spec, ranks)
        claims += len(ranks) * spec.tp
    if claimed >> n or claimed.bit_count() != claims:
        return False
    return sorted(result.idle_devices) == devices.listed(~claimed)


def _violations(snap: Snapshot, result: Plan) -> list[str]:
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
