"""What a plan must never break, checked before the coordinator applies one: every
claim on a device (fence, held or granted stage, awake bundle) disjoint and on an
existing device, shrinks and expands of ranks that exist, grants of requests that
wait. :func:`check_plan` lists every broken invariant (empty when the plan is
sound); :func:`idle_after` derives the devices a plan leaves idle.
"""

from __future__ import annotations

from collections.abc import Collection

from rlix_async.control.device_masks import FRAMES, Devices, new_frame
from rlix_async.protocols.snapshot import Plan, Snapshot
from rlix_async.protocols.topology import INFER


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
    changed: dict[str, set[int]] = {}  # awake ranks of the pipelines the plan changes

    def active(pid: str) -> set[int]:
        ranks = changed.get(pid)
        if ranks is None:
            ranks = changed[pid] = set(pipes[pid].active_ranks.get(INFER, ()))
        return ranks

    for ch in result.shrink:
        ranks = set(ch.ranks)
        if ch.pipeline not in pipes or ch.cluster != INFER or len(ranks) != len(ch.ranks):
            return False
        if not ranks <= active(ch.pipeline):
            return False
        active(ch.pipeline).difference_update(ranks)
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
        if not ranks.isdisjoint(active(grown.id)) or not ranks.isdisjoint(
            grown.offline_ranks.get(INFER, ())
        ):
            return False
        active(grown.id).update(ranks)
    for pid, p in pipes.items():
        listed: Collection[int] | None = changed.get(pid)
        if listed is None:
            listed = p.active_ranks.get(INFER)  # a list: it may repeat a rank
        if not listed:
            continue
        spec = p.clusters.get(INFER)
        if spec is None:
            return False
        frame = FRAMES.get(id(spec.devices))  # frame_of(spec, devices), sooner
        if frame is None or frame.listed is not spec.devices or frame.tp != spec.tp or frame.n != n:
            frame = new_frame(spec, devices)
        if frame.units is None:
            if min(listed) < 0 or max(listed) >= spec.dp:
                return False
            ranks = set(listed)
            claimed |= devices.bundles(spec, ranks)
            claims += len(ranks) * spec.tp
        else:  # disjoint bundles of tp bits each: the bits count the distinct ranks
            bits = frame.summed(listed)
            if bits is None:  # a rank out of range: _violations decides
                return False
            size = bits.bit_count()
            if size != len(listed) * frame.tp:  # carries: a rank listed twice
                bits = frame.starts_of(set(listed)) * frame.block
                size = bits.bit_count()
            claimed |= bits << spec.devices[0]  # (the frame's offset)
            claims += size
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
