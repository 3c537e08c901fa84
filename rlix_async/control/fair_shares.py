"""Water-filling for the planner: a proportional split of devices with floors and caps.

:func:`water_fill` is defined by its bisection on ``lam``: the last bits of ``lam``
decide how shares round to whole bundles downstream, so the bisection itself is
kept. Only the question each step asks, ``total(lam) < capacity``, is answered
faster: from a sorted-breakpoint estimate of ``total`` when that is certain (it
is off by far less than its margin), and by the exact sum otherwise, so every
answer, hence ``lam`` and every share, is bit for bit what the plain sum gives.

Around it: :func:`guaranteed_floors` (a bundle for every pipeline with demand,
while they fit) and :func:`bundle_targets` (shares to whole bundles, with
hysteresis).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from itertools import accumulate, compress
from operator import mul, sub, truediv

# A term is (cap, floor, weight): its share of lam is min(cap, max(floor, lam * weight)).
# Terms are their caps, floors and weights, as three lists.
Terms = tuple[list[float], list[float], list[float]]


def water_fill(
    capacity: float,
    weights: dict[str, float],
    caps: dict[str, float],
    floors: dict[str, float] | None = None,
) -> dict[str, float]:
    """Split ``capacity`` in proportion to ``weights``, each share clamped to
    ``[floor, cap]``: share = clamp(lam * weight), with lam found by bisection."""
    floors = floors or {}
    # The terms (cap, floor, weight) as three lists. Here and below, ``b if b < a else a``
    # is ``min(a, b)`` and ``b if b > a else a`` is ``max(a, b)``, the very same object.
    keys = [k for k, w in weights.items() if w > 0 and caps[k] > 0]
    cs = list(map(caps.__getitem__, keys))
    los = [c if c < (lo := floors.get(k, 0.0)) else lo for k, c in zip(keys, cs, strict=True)]
    ws = list(map(weights.__getitem__, keys))

    def total(lam: float) -> float:  # sum(min(c, max(lo, lam * w)) over the terms)
        return sum(
            [
                m if (m := v if (v := lam * w) > lo else lo) < c else c
                for c, lo, w in zip(cs, los, ws, strict=True)
            ]
        )

    share = dict.fromkeys(weights, 0.0)
    if not keys:
        return share
    below = _below(capacity, (cs, los, ws), total)
    if not below(0.0):  # total(0.0) >= capacity: the floors alone use everything
        share.update(zip(keys, los, strict=True))
        return share
    hi = 1.0
    while hi < 1e18 and below(hi):
        hi *= 2
    lo = 0.0
    for _ in range(80):
        mid = (lo + hi) / 2
        step = (mid, hi) if below(mid) else (lo, mid)
        if step == (lo, hi):  # a fixed point: the remaining steps change nothing
            break
        lo, hi = step
    for k, c, floor, w in zip(keys, cs, los, ws, strict=True):
        share[k] = m if (m := v if (v := hi * w) > floor else floor) < c else c
    return share


def _below(
    capacity: float, terms: Terms, total: Callable[[float], float]
) -> Callable[[float], bool]:
    """``lam -> total(lam) < capacity``, exactly as ``total`` answers it.

    ``total`` is piecewise linear in ``lam``: with the breakpoints ``floor/weight``
    (a term leaves its floor) and ``cap/weight`` (it reaches its cap) sorted once,
    it is ``sum(floors) + lam * (weights between) - (their floors) + (the caps
    passed)``, read from prefix sums in O(log n). That estimate and ``total`` are
    each within ``(3n + 8)`` rounding units of ``sum(|floor| + |cap|) + lam * sum(weight)``
    of the true value; ``margin`` allows both, and only answers inside it are
    computed exactly (by :func:`_pinned` terms near ``lam``, else by ``total``).
    """
    caps, floors, weights = terms
    size = sum(map(abs, caps)) + sum(map(abs, floors))
    weight_sum = sum(weights)
    if not math.isfinite(size + weight_sum):
        return lambda lam: total(lam) < capacity
    leave = list(map(truediv, floors, weights))  # lam where each term leaves its floor
    reach = list(map(truediv, caps, weights))  # and where it reaches its cap
    by_leave = sorted(range(len(caps)), key=leave.__getitem__)
    by_reach = sorted(range(len(caps)), key=reach.__getitem__)
    leave_at = list(map(leave.__getitem__, by_leave))
    reach_at = list(map(reach.__getitem__, by_reach))
    w_left = [0.0, *accumulate(map(weights.__getitem__, by_leave))]
    lo_left = [0.0, *accumulate(map(floors.__getitem__, by_leave))]
    w_capped = [0.0, *accumulate(map(weights.__getitem__, by_reach))]
    c_capped = [0.0, *accumulate(map(caps.__getitem__, by_reach))]
    base = sum(floors)
    unit = (6 * len(caps) + 16) * 1.12e-16  # twice (3n + 8) units of 2**-53
    near: list[float] = [1.0, 0.0]  # the lam range the pinned terms hold for
    pinned: list[tuple[float | None, float]] | None = None

    def exact(lam: float) -> float:
        nonlocal pinned
        if not near[0] <= lam <= near[1]:
            near[:] = [lam * (1 - 1e-6), lam * (1 + 1e-6)]
            pinned = _pinned(terms, near[0], near[1])
        if pinned is None:
            return total(lam)
        return sum([c if w is None else lam * w for w, c in pinned])

    def below(lam: float) -> bool:
        i = bisect_left(leave_at, lam)
        j = bisect_left(reach_at, lam)
        est = base + lam * (w_left[i] - w_capped[j]) - (lo_left[i] - c_capped[j])
        margin = unit * (size + lam * weight_sum)
        if est < capacity - margin:
            return True
        if est > capacity + margin:
            return False
        return exact(lam) < capacity

    return below


def _pinned(terms: Terms, a: float, b: float) -> list[tuple[float | None, float]] | None:
    """Each term for every ``lam`` in ``[a, b]`` (``0 <= a``): ``(weight, _)`` where it is
    exactly ``lam * weight``, ``(None, value)`` where it is the very object ``min`` and
    ``max`` return (so a sum over them equals ``total``'s, types and all); None when
    a term meets its floor or cap in that range."""
    out: list[tuple[float | None, float]] = []
    for c, lo, w in zip(*terms, strict=True):
        at_a, at_b = a * w, b * w  # lam * w is monotone in lam, rounded or not
        if at_b <= lo:
            out.append((None, lo if lo < c else c))  # min(c, lo)
        elif at_a >= c:
            out.append((None, c))
        elif lo < at_a and at_b < c:
            out.append((w, 0.0))
        else:
            return None
    return out


# Finish-time fairness (Themis, NSDI'20): a pipeline's rollout weight is scaled by
# (its slowdown / the mean slowdown) ** FAIRNESS_EXPONENT, the ratio clipped to
# [1/FAIRNESS_CLIP, FAIRNESS_CLIP]. A high exponent serves the worst-off first while
# still dividing devices: on 30 generated agentic draws (docs/PERF.md, "Fair while
# sharing") 8 reads a sharing index <= 1.2 on more draws than 6 or 12 (and, with an
# oracle's paces, than 2, 4, 16 or 32); the clip bounds what a pipeline whose estimate
# is wildly off (or understated) takes from the others.
FAIRNESS_EXPONENT = 8
FAIRNESS_CLIP = 4.0


def finish_time_factors(slowdown: dict[str, float | None]) -> dict[str, float]:
    """Each pipeline's weight factor from its slowdown against its pace alone: its
    slowdown over the mean of the known ones, clipped, to ``FAIRNESS_EXPONENT``; 1.0
    for a pipeline whose slowdown is not known (None) or when none is."""
    slowdown = {
        k: v if v is not None and math.isfinite(v) and v > 0 else None for k, v in slowdown.items()
    }
    known = [v for v in slowdown.values() if v is not None]
    if not known:
        return dict.fromkeys(slowdown, 1.0)
    mean = sum(known) / len(known)
    lo, hi = 1 / FAIRNESS_CLIP, FAIRNESS_CLIP
    return {
        pid: 1.0 if v is None else min(hi, max(lo, v / mean)) ** FAIRNESS_EXPONENT
        for pid, v in slowdown.items()
    }


def guaranteed_floors(
    capacity: int,
    wanting: list[str],
    weights: dict[str, float],
    tp: dict[str, int],
    caps: dict[str, float],
    by_id: list[str] | None = None,
) -> dict[str, float]:
    """One bundle for every pipeline with demand, largest demand first, while it fits.
    (``by_id``: ``sorted(wanting)``, where the caller has it.)"""
    if sum(map(tp.__getitem__, wanting)) <= capacity:  # all fit: the order is moot
        return {pid: tp[pid] for pid in wanting if caps[pid] >= tp[pid]}
    floors: dict[str, float] = {}
    left = capacity
    total = sum(weights.values())
    if total == total:  # no NaN: the (-weight, id) order
        order = sorted(by_id or sorted(wanting), key=weights.__getitem__, reverse=True)
    else:
        order = sorted(wanting, key=lambda q: (-weights[q], q))
    for pid in order:
        if tp[pid] <= left and caps[pid] >= tp[pid]:
            floors[pid] = tp[pid]
            left -= tp[pid]
    return floors


def bundle_targets(
    wanting: list[str],
    by_id: list[str],
    ideal: dict[str, float],
    tps: dict[str, int],
    active: dict[str, set[int]],
    caps: dict[str, float],
    capacity: int,
    idle: int,
    owed: set[str] | None = None,
) -> dict[str, int]:
    """Whole bundles per pipeline: largest remainder, at least one, then hysteresis.
    (``by_id`` is ``sorted(wanting)``.) With ``owed`` (finish-time fairness), only
    those are owed one bundle: when the total does not fit once every share above one
    bundle is trimmed, the others are trimmed to none.

    Hysteresis never leaves a device idle: a pipeline within one bundle of its
    ideal still grows by that bundle when ``idle`` devices (unowned, or held by a
    shard of a pipeline with nothing left to generate) can hold it.
    """
    per_tp = list(map(tps.__getitem__, wanting))
    shares = list(map(truediv, map(ideal.__getitem__, wanting), per_tp))
    wholes = list(map(int, shares))
    exact = dict(zip(wanting, shares, strict=True))
    target = dict(zip(wanting, wholes, strict=True))
    rest = dict(zip(wanting, map(sub, shares, wholes), strict=True))
    room = capacity - sum(map(mul, wholes, per_tp))
    # Largest remainder first, then by id (an ideal share is never NaN), while some
    # bundle fits: a remainder > 0 is exact > target, and room only shrinks.
    least = min(tps.values(), default=0)
    for pid in sorted(by_id, key=rest.__getitem__, reverse=True) if room >= least else ():
        if rest[pid] <= 0 or room < least:
            break
        tp = tps[pid]
        if room >= tp and (target[pid] + 1) * tp <= caps[pid]:
            target[pid] += 1
            room -= tp
    currents = map(len, map(active.__getitem__, wanting))
    for pid, tp, share, current, cap in zip(
        wanting, per_tp, shares, currents, map(caps.__getitem__, wanting), strict=True
    ):
        whole = target[pid]
        if whole == 0 and cap >= tp:  # every pipeline with demand gets a bundle when it
            whole = target[pid] = 1  # can reach one
        # hysteresis: a current share within one bundle of ideal stays
        if current and -1 <= current - share <= 1 and current * tp <= cap:
            if whole > current and idle >= tp:
                target[pid] = current + 1
                idle -= tp
            else:
                target[pid] = current
    # Keep the total feasible: trim those furthest above their ideal (never below the
    # one bundle they are owed).
    total = sum(map(mul, map(target.__getitem__, wanting), per_tp))
    while total > capacity:
        over = [pid for pid in wanting if target[pid] > 1]
        if not over and owed is not None:  # then those not owed their one
            over = [pid for pid in wanting if target[pid] and pid not in owed]
        if not over:
            break
        # the largest (target - exact, id)
        above = list(map(sub, map(target.__getitem__, over), map(exact.__getitem__, over)))
        worst = max(compress(over, map(max(above).__eq__, above)))  # (by id, last)
        target[worst] -= 1
        total -= tps[worst] * wanting.count(worst)  # once, unless pipeline ids repeat
    return target
