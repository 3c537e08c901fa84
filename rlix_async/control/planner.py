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
   gets at least one bundle when one is free. Under ``policy.fairness:
   finish_time`` (the default) each weight is also scaled by the pipeline's
   slowdown against its pace alone (``_finish_time``), and only pipelines of
   unknown pace or starving are owed that bundle when bundles run short.
3. Hysteresis: moving a shard costs a sleep, a wake and a weight sync, so a
   pipeline whose current share is within one bundle of its ideal keeps it, and
   shards of a pipeline without demand are only shrunk when another pipeline
   with unmet demand could use their devices.

:func:`~rlix_async.control.plan_checks.check_plan` re-derives the resulting
ownership and lists every broken invariant; the coordinator never applies a plan
with violations.

Sets of devices are int bitmasks here (:mod:`rlix_async.control.device_masks`),
so a plan over thousands of devices takes milliseconds; the water-filling, its
floors and the rounding to whole bundles are :mod:`rlix_async.control.fair_shares`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass, field
from itertools import chain

from rlix_async.control.device_masks import FRAMES, Counts, Devices, Frame, frame_of, new_frame
from rlix_async.control.fair_shares import (
    bundle_targets,
    finish_time_factors,
    guaranteed_floors,
    water_fill,
)
from rlix_async.protocols.snapshot import (
    Grant,
    PipelineIn,
    Plan,
    Policy,
    ProgressIn,
    RankChange,
    RequestIn,
    Snapshot,
    Waiting,
)
from rlix_async.protocols.topology import INFER, ClusterShape, Priority

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
    # The same as device masks (device_masks): ``owned`` and ``blocked`` are the keys
    # of ``owner`` and of all ``reserved``; ``shards[pid]`` is pid's awake bundles in its
    # frame, kept in step with ``active`` by shrink(), and ``seen`` their devices, all
    # shards together. Awake ranks out of range or sharing a device (a snapshot that
    # fails validation) make the state ``irregular``: ``shards`` and ``seen`` are then
    # unused and gen_holder() answers instead.
    devices: Devices = field(init=False)
    owned: int = 0
    blocked: int = 0
    shards: dict[str, int] = field(default_factory=dict)
    indexed: dict[str, int] = field(default_factory=dict)  # shards' devices, before shrinks
    seen: int = 0
    irregular: bool = False
    frames: dict[str, Frame] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.devices = Devices(self.shape.num_devices)

    def index_shards(self) -> None:
        seen = count = 0  # the union of the shards' devices, and their sizes summed
        pipes, frames, devices = self.pipes, self.frames, self.devices
        shards, indexed, n = self.shards, self.indexed, self.devices.n
        for pid, ranks in self.active.items():
            if not ranks:  # (a base group's member never has any: its group does)
                continue
            spec = pipes[pid].clusters[INFER]
            frame = FRAMES.get(id(spec.devices))  # frame_of(spec, devices), sooner
            if (
                frame is None
                or frame.listed is not spec.devices
                or frame.tp != spec.tp
                or frame.n != n
            ):
                frame = new_frame(spec, devices)
            frames[pid] = frame
            shard = frame.summed(ranks)  # disjoint bundles of a range of ids
            if shard is not None:
                mask = shard << spec.devices[0]  # (the frame's offset)
                size = shard.bit_count()
            else:
                if min(ranks) < 0 or max(ranks) >= frame.dp:
                    self.irregular = True
                    continue
                shard = frame.shard(ranks)
                mask = frame.spread(shard)
                size = mask.bit_count()
                if size != len(ranks) * frame.tp:
                    self.irregular = True
            shards[pid] = shard
            indexed[pid] = mask
            seen |= mask
            count += size
        self.seen = seen
        if seen.bit_count() != count:  # shards share a device
            self.irregular = True

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
        return self.owned | self.seen

    def shrink(self, pid: str, ranks: Collection[int]) -> None:
        self.active[pid].difference_update(ranks)
        self.shrunk[pid].update(ranks)
        if not self.irregular:
            frame = self.frames[pid]
            gone = self.shards[pid] & frame.shard(ranks)
            self.shards[pid] ^= gone
            self.seen ^= frame.spread(gone)  # (seen has them: shards are disjoint)


def plan(snap: Snapshot) -> Plan:
    """Decide grants, shrinks and expands for one snapshot. Pure and deterministic."""
    st = _State(snap.cluster, {p.id: p for p in snap.pipelines})
    _prepare(snap, st)
    st.index_shards()
    out = Plan()
    _serve_gang_requests(snap, st, out)
    busy = _allocate_generation(snap, st, out)
    out.shrink = [
        RankChange(pid, INFER, sorted(ranks)) for pid, ranks in sorted(st.shrunk.items()) if ranks
    ]
    out.idle_devices = st.devices.listed(~busy)
    return out


def _prepare(snap: Snapshot, st: _State) -> None:
    """Fences, stages held, demand and awake ranks into ``st``."""
    devices, owner, demand, active = st.devices, st.owner, st.demand, st.active
    for d in snap.fenced:  # a shard may still hold it: as good as held by a stage
        owner[d] = FENCED
    owned = devices.mask(snap.fenced)
    for p in snap.pipelines:
        pid = p.id
        if INFER in p.clusters:
            progress = p.progress
            if type(progress) is list and len(progress) == 1:
                progress = progress[0]  # one stream (as the registry lists it)
            if type(progress) is ProgressIn:  # one stream: _demand(p), sooner
                target, completed = progress.target, progress.completed
                demand[pid] = target - (target if target < completed else completed)
            else:
                demand[pid] = _demand(p)
        if p.held:
            for cname in p.held:
                held = p.clusters[cname].devices
                owner.update(dict.fromkeys(held, (pid, cname)))
                owned |= devices.mask(held)
        ranks = p.active_ranks.get(INFER)
        active[pid] = set(ranks) if ranks else set()
    st.owned = owned


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
    if not granted_mask:
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


def _allocate_generation(snap: Snapshot, st: _State, out: Plan) -> int:
    """Shrinks and expands for generation; returns the devices busy afterwards
    (held by a stage, fenced, or under an awake shard) as a device mask."""
    pipes = [p for p in snap.pipelines if INFER in p.clusters]
    wanting = [p.id for p in pipes if st.demand[p.id] > 0]
    reach, tps, caps, weights, usable = _reachable_bundles(st, wanting)
    by_id = sorted(wanting)
    owed = None  # every pipeline with demand is owed a bundle (policy "demand")
    if snap.policy.fairness == "finish_time" and wanting:
        owed = _finish_time(snap.policy, st, wanting, weights)
    target = _shard_targets(st, wanting, by_id, tps, caps, weights, usable, owed)
    # Devices each under-target pipeline could use: shrink others there first.
    hungry = [pid for pid in wanting if len(st.active[pid]) < target[pid]]
    asleep: dict[str, int] = {}
    hungry_devices = Counts()
    for pid in hungry:
        asleep[pid] = reach[pid] & ~_awake(st, pid)
        st.frames[pid].count(hungry_devices, asleep[pid])
    _shrink_toward_targets(st, pipes, target, hungry_devices)
    taken = _expand_toward_targets(st, out, by_id, hungry, target, asleep, hungry_devices)
    for pid in [pid for pid in wanting if not st.active[pid]]:
        blocked = "every reachable bundle is held by a stage or reserved"
        if owed is not None and not target[pid] and reach[pid]:
            blocked = "its share goes to pipelines slowed more or starving (finish-time fairness)"
        out.waiting.append(Waiting(pid, INFER, f"generation: {blocked}"))
    return taken


def _reachable_bundles(
    st: _State, wanting: list[str]
) -> tuple[dict[str, int], dict[str, int], dict[str, float], dict[str, float], int]:
    """Per pipeline with demand, the bundles it may run on (frame starts), its tp, its
    capacity in devices and its fair-share weight; and every device some of them may use.

    A bundle may be used where no device is held by a stage, the rank is not offline,
    and no device is reserved unless the shard already runs there. Stages, fences and
    reservations are settled now; awake ranks still change later, but only for
    pipelines with no demand or above their target, never for one that grows. (A
    pipeline id listed twice is its last listing here, as in ``st.pipes``.)"""
    frames, devices, owned, blocking = st.frames, st.devices, st.owned, st.blocked
    reach: dict[str, int] = {}
    tps: dict[str, int] = {}
    caps: dict[str, float] = {}
    weights: dict[str, float] = {}
    usable = 0
    for pid in wanting:
        p = st.pipes[pid]
        spec = p.clusters[INFER]
        frame = frames.get(pid)
        if frame is None:
            frame = frames[pid] = frame_of(spec, devices)
        offset = frame.offset
        if offset is not None:  # frame.touched(frame.local(owned)), inline
            near = (owned >> offset) & frame.full
            for step in frame.folds:
                near |= near >> step
            ok = frame.starts & ~near
        else:
            ok = frame.starts & ~frame.touched(frame.local(owned))
        if blocking:
            reserved = frame.local(blocking)
            if reserved:
                ok &= ~frame.touched(reserved) | _awake(st, pid)
        offline = p.offline_ranks.get(INFER)
        if offline:
            ok &= ~frame.ranks_in(offline)
        reach[pid] = ok
        tp = tps[pid] = spec.tp
        caps[pid] = tp * ok.bit_count()
        weights[pid] = p.weight * st.demand[pid] * tp
        if offset is not None:
            usable |= ok * frame.block << offset
        else:
            usable |= frame.spread(ok * frame.block)
    return reach, tps, caps, weights, usable


def _finish_time(
    policy: Policy, st: _State, wanting: list[str], weights: dict[str, float]
) -> list[str]:
    """Finish-time fairness: scale each pipeline's weight by its slowdown against the
    others' (fair_shares.finish_time_factors) and return those still owed a one-bundle
    floor: a pipeline whose pace is not known yet, and one starving (its progress stood
    still for ``policy.starvation_s``)."""
    pipes = st.pipes
    slowdown = {pid: pipes[pid].slowdown for pid in wanting}
    for pid, factor in finish_time_factors(slowdown).items():
        weights[pid] *= factor
    return [
        pid
        for pid in wanting
        if slowdown[pid] is None or pipes[pid].stalled_s >= policy.starvation_s
    ]


def _shard_targets(
    st: _State,
    wanting: list[str],
    by_id: list[str],
    tps: dict[str, int],
    caps: dict[str, float],
    weights: dict[str, float],
    usable: int,
    owed: list[str] | None = None,
) -> dict[str, int]:
    """How many shards each pipeline with demand should have: guaranteed floors (for
    ``owed``, else for all of them), then water-filling by weight over the usable
    devices, rounded to whole bundles."""
    capacity = usable.bit_count()
    if owed is None:
        floors = guaranteed_floors(capacity, wanting, weights, tps, caps, by_id)
    else:
        floors = guaranteed_floors(capacity, owed, weights, tps, caps)
    ideal = water_fill(capacity, weights, caps, floors)
    # Free for the taking: unowned devices and shards of pipelines with nothing to generate.
    demand = st.demand
    if st.irregular:
        gen = st.gen_holder()
        busy_gen = st.devices.mask([d for d, (pid, _) in gen.items() if demand.get(pid, 0) > 0])
    else:  # the shards of those with demand: all shards (disjoint) but the others'
        busy_gen = st.seen
        for pid, shard in st.shards.items():
            if not demand[pid] > 0:
                busy_gen ^= st.frames[pid].spread(shard)
    idle = (usable & ~st.owned & ~busy_gen).bit_count()
    owing = None if owed is None else set(owed)
    return bundle_targets(wanting, by_id, ideal, tps, st.active, caps, capacity, idle, owing)


def _shrink_toward_targets(
    st: _State, pipes: list[PipelineIn], target: dict[str, int], hungry_devices: Counts
) -> None:
    """Shards of pipelines with no demand that sit where a hungry one could run, and
    shards above a pipeline's target (the most contended first, then high ranks)."""
    active, frames = st.active, st.frames
    contended = hungry_devices.support()
    for p in pipes:
        pid = p.id
        ranks = active[pid]
        if not ranks:
            continue
        if st.demand[pid] == 0:
            if not contended:
                continue
            frame = frames[pid]
            if st.irregular:
                hit = [r for r in sorted(ranks) if frame.bundle(r) & contended]
            else:
                hit = frame.ranks(frame.touched(frame.local(contended)) & st.shards[pid])
            st.shrink(pid, hit)
            continue
        excess = len(ranks) - target[pid]
        if excess > 0:
            frame = frames[pid]
            load = frame.loads(hungry_devices, ranks)
            by_load = sorted(sorted(ranks, reverse=True), key=load.__getitem__, reverse=True)
            st.shrink(pid, by_load[:excess])


def _expand_toward_targets(
    st: _State,
    out: Plan,
    by_id: list[str],
    hungry: list[str],
    target: dict[str, int],
    asleep: dict[str, int],
    hungry_devices: Counts,
) -> int:
    """Wake ranks of under-target pipelines, neediest first (the largest gap between
    target and current share, then by id), preferring bundles other hungry pipelines
    cannot use, then low ranks. Returns the devices busy afterwards."""
    active, frames = st.active, st.frames
    taken = st.busy()
    expands: dict[str, list[int]] = defaultdict(list)
    gap = {pid: len(active[pid]) / max(target[pid], 1) for pid in hungry}
    for pid in sorted([q for q in by_id if q in gap], key=gap.__getitem__):
        frame = frames[pid]
        # Reachable and asleep (so not reserved), and not taken since.
        if frame.offset is not None:  # frame.touched(frame.local(taken)), inline
            near = (taken >> frame.offset) & frame.full
            for step in frame.folds:
                near |= near >> step
            starts = asleep[pid] & ~near  # (asleep: starts only)
        else:
            starts = asleep[pid] & ~frame.touched(frame.local(taken))
        free = frame.ranks(starts) if starts else []
        wanted = max(target[pid] - len(active[pid]), 0)
        if len(free) > wanted:
            free.sort(key=frame.loads(hungry_devices, free).__getitem__)
        chosen = free[:wanted]
        expands[pid] += chosen
        if chosen:
            taken |= frame.spread(frame.shard(chosen))
            active[pid].update(expands[pid])
    # A rank shrunk and expanded in the same plan is simply kept.
    for pid, expanded in expands.items():
        if not expanded:
            continue
        kept = set(expanded) & st.shrunk[pid]
        st.shrunk[pid] -= kept
        fresh = sorted(set(expanded) - kept)
        if fresh:
            out.expand.append(RankChange(pid, INFER, fresh))
    return taken
