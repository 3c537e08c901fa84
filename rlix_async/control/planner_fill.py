"""Water-filling for the planner: a proportional split of devices with floors and caps.

:func:`water_fill` is defined by its bisection on ``lam``: the last bits of ``lam``
decide how shares round to whole bundles downstream, so the bisection itself is
kept. Only the question each step asks, ``total(lam) < capacity``, is answered
faster: from a sorted-breakpoint estimate of ``total`` when that is certain (it
is off by far less than its margin), and by the exact sum otherwise, so every
answer, hence ``lam`` and every share, is bit for bit what the plain sum gives.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable
from itertools import accumulate
from operator import truediv

# A term is (cap, floor, weight): its share of lam is min(cap, max(floor, lam * weight)).
Term = tuple[float, float, float]


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
    terms: list[Term] = [(caps[k], min(floors.get(k, 0.0), caps[k]), weights[k]) for k in keys]

    def total(lam: float) -> float:
        return sum(min(c, max(lo, lam * w)) for c, lo, w in terms)

    share = dict.fromkeys(weights, 0.0)
    if not keys:
        return share
    if total(0.0) >= capacity:  # the floors alone use everything
        for k, (_, lo, _) in zip(keys, terms, strict=True):
            share[k] = lo
        return share
    below = _below(capacity, terms, total)
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
    for k, (c, lo, w) in zip(keys, terms, strict=True):
        share[k] = min(c, max(lo, hi * w))
    return share


def _below(
    capacity: float, terms: list[Term], total: Callable[[float], float]
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
    caps, floors, weights = (list(x) for x in zip(*terms, strict=True))
    size = sum(map(abs, caps)) + sum(map(abs, floors))
    weight_sum = sum(weights)
    if not math.isfinite(size + weight_sum):
        return lambda lam: total(lam) < capacity
    leave = list(map(truediv, floors, weights))  # lam where each term leaves its floor
    reach = list(map(truediv, caps, weights))  # and where it reaches its cap
    by_leave = sorted(range(len(terms)), key=leave.__getitem__)
    by_reach = sorted(range(len(terms)), key=reach.__getitem__)
    leave_at = list(map(leave.__getitem__, by_leave))
    reach_at = list(map(reach.__getitem__, by_reach))
    w_left = [0.0, *accumulate(map(weights.__getitem__, by_leave))]
    lo_left = [0.0, *accumulate(map(floors.__getitem__, by_leave))]
    w_capped = [0.0, *accumulate(map(weights.__getitem__, by_reach))]
    c_capped = [0.0, *accumulate(map(caps.__getitem__, by_reach))]
    base = sum(floors)
    unit = (6 * len(terms) + 16) * 1.12e-16  # twice (3n + 8) units of 2**-53
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


def _pinned(terms: list[Term], a: float, b: float) -> list[tuple[float | None, float]] | None:
    """Each term for every ``lam`` in ``[a, b]`` (``0 <= a``): ``(weight, _)`` where it is
    exactly ``lam * weight``, ``(None, value)`` where it is the very object ``min`` and
    ``max`` return (so a sum over them equals ``total``'s, types and all); None when
    a term meets its floor or cap in that range."""
    out: list[tuple[float | None, float]] = []
    for c, lo, w in terms:
        at_a, at_b = a * w, b * w  # lam * w is monotone in lam, rounded or not
        if at_b <= lo:
            out.append((None, min(c, lo)))
        elif at_a >= c:
            out.append((None, c))
        elif lo < at_a and at_b < c:
            out.append((w, 0.0))
        else:
            return None
    return out
