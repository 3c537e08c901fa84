"""Device sets as int bitmasks, for the planner.

A plan handles thousands of devices, and a Python set of them costs a hash per
device for every union, test and count. Here a set of devices is an ``int``:
bit ``d`` is device ``d`` (a device outside ``0..n-1``, which only a snapshot
that fails validation names, gets a spare bit above ``n``), so a union, an
intersection or a count is one integer operation.

A pipeline's generation cluster is read through a :class:`Frame`, whose bit
``i`` is the cluster's ``devices[i]``: rank ``r``'s bundle is bits ``r*tp`` to
``r*tp + tp - 1``, and a set of ranks is the set of their first bits
("starts"). For the usual device list, a range of device ids, moving between a
frame and the cluster is a shift; any other list (gaps, or the duplicates and
odd ids of an invalid topology) is handled device by device, with the same
results.

:func:`frame_of` shares the frame of a range of device ids between plans (a
frame is a function of its immutable device tuple, its tp and the cluster size),
and :meth:`Frame.summed` remembers the bits of the rank sets it has seen (per dp
and tp): a coordinator plans for the same pipelines again and again.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from functools import lru_cache
from itertools import chain, compress
from typing import Any

from rlix_async.protocols.topology import ClusterSpec

_BIT = bytes.maketrans(b"01", b"\x00\x01")


class Devices:
    """Bit positions of the devices of one cluster of ``n`` devices."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.ids = _ids(n)
        self.spare: dict[int, int] = {}

    def bit(self, d: int) -> int:
        if 0 <= d < self.n:
            return d
        return self.spare.setdefault(d, self.n + len(self.spare))

    def mask(self, devices: Iterable[int]) -> int:
        if type(devices) is tuple and devices:
            first = devices[0]
            if self.ids[first : first + len(devices)] == devices:  # a range of ids
                return ((1 << len(devices)) - 1) << first
        out = 0
        for d in devices:
            out |= 1 << self.bit(d)
        return out

    def bundles(self, spec: ClusterSpec, ranks: Iterable[int]) -> int:
        """The devices of ``spec.bundle(r)`` for each of ``ranks`` (all in ``range(dp)``)."""
        tp, listed = spec.tp, spec.devices
        if listed and self.ids[listed[0] : listed[0] + len(listed)] == listed:
            starts = 0
            for r in ranks:
                starts |= 1 << (r * tp)
            return starts * ((1 << tp) - 1) << listed[0]
        return self.mask(chain.from_iterable(map(spec.bundle, ranks)))

    def listed(self, mask: int) -> list[int]:
        """The devices ``0..n-1`` in ``mask``, ascending."""
        global _LISTED
        n = self.n
        mask &= (1 << n) - 1
        last_n, last_mask, last = _LISTED  # a plan and its check ask for the same
        if last_n == n and last_mask == mask:
            return list(last)
        text = format(mask, f"0{n}b")[::-1] if n else ""
        if (mask ^ (mask << 1)).bit_count() <= _RUNS:  # few runs of devices: run by run
            out: list[int] = []
            i = text.find("1")
            while i >= 0:
                j = text.find("0", i)
                j = n if j < 0 else j
                out += self.ids[i:j]
                i = text.find("1", j)
        else:
            out = list(compress(self.ids, text.encode().translate(_BIT)))
        _LISTED = (n, mask, tuple(out))
        return out


class Frame:
    """A generation cluster's devices as bits ``0 .. dp*tp - 1`` (see the module)."""

    __slots__ = (
        "_devices",
        "block",
        "dp",
        "folds",
        "full",
        "listed",
        "memo",
        "n",
        "offset",
        "span",
        "starts",
        "tp",
        "units",
    )

    def __init__(self, spec: ClusterSpec, devices: Devices) -> None:
        listed = spec.devices
        # dp, its bits, one bundle (at bit 0), every rank's start, every bit, or-folds
        layout = _layout(len(listed), spec.tp)
        self.tp, self.dp, self.span, self.block, self.starts, self.full, self.folds = layout[:7]
        span = self.span
        self.listed = listed  # (not spec: a frame kept by frame_of() keeps no more)
        self._devices = devices
        self.n = devices.n
        self.offset: int | None = None
        # Where the devices are a range of ids, all in bundles: rank -> its bundle's bits,
        # and summed()'s memory, shared by every frame of this dp and tp; else None.
        self.units: tuple[int | float, ...] | None = None
        self.memo: dict[bytes, int] = _NO_MEMO
        if span:
            first = listed[0]
            if devices.ids[first : first + span] == (
                listed if span == len(listed) else listed[:span]
            ):
                self.offset = first
                if span == len(listed):
                    self.units, self.memo = layout[7:]

    def local(self, mask: int) -> int:
        """Cluster device mask -> frame mask."""
        if self.offset is not None:
            return (mask >> self.offset) & self.full
        bit = self._devices.bit
        out = 0
        for i, d in enumerate(self.listed[: self.span]):
            out |= (mask >> bit(d) & 1) << i
        return out

    def spread(self, x: int) -> int:
        """Frame mask -> cluster device mask."""
        if self.offset is not None:
            return x << self.offset
        return self._devices.mask(compress(self.listed, _flags(x, self.span)))

    def bundle(self, rank: int) -> int:
        """The devices of ``spec.bundle(rank)`` (any rank, in range or not)."""
        if self.offset is not None and 0 <= rank < self.dp:
            return self.block << (self.offset + rank * self.tp)
        return self._devices.mask(self._bundle(rank))

    def _bundle(self, rank: int) -> tuple[int, ...]:
        """``spec.bundle(rank)``."""
        return self.listed[rank * self.tp : (rank + 1) * self.tp]

    def ranks_in(self, ranks: Iterable[int]) -> int:
        """The starts of those of ``ranks`` in ``range(dp)``."""
        out = 0
        for r in ranks:
            if 0 <= r < self.dp:
                out |= 1 << (r * self.tp)
        return out

    def starts_of(self, ranks: Collection[int]) -> int:
        """The starts of ``ranks``: distinct, all in ``range(dp)``."""
        out, tp = 0, self.tp
        for r in ranks:
            out |= 1 << (r * tp)
        return out

    def shard(self, ranks: Collection[int]) -> int:
        """The bits of the bundles of ``ranks`` (distinct, all in ``range(dp)``)."""
        return self.starts_of(ranks) * self.block

    def summed(self, ranks: Collection[int]) -> int | None:
        """The sum of ``units`` over ``ranks``: the bits of their bundles where they are
        distinct. None where a rank is not an int in ``range(dp)`` (nor in 0 .. 255), or
        the frame has no units. Remembered by the ranks in their order, for every frame
        of this dp and tp."""
        units = self.units
        if units is None:
            return None
        try:
            key = bytes(ranks)  # ints in 0 .. 255, or it raises
        except (TypeError, ValueError):
            return None
        out = self.memo.get(key)
        if out is None:
            try:
                total = sum(map(units.__getitem__, ranks))
            except IndexError:  # a rank >= 2 dp
                return None
            if type(total) is not int:  # a rank in dp .. 2 dp - 1 met a NaN
                return None
            if len(self.memo) >= _MEMO_MAX:
                self.memo.clear()
            out = self.memo[key] = total
        return out

    def ranks(self, starts: int) -> list[int]:
        """The ranks whose start is in ``starts``, ascending."""
        out = []
        while starts:
            low = starts & -starts
            out.append((low.bit_length() - 1) // self.tp)
            starts ^= low
        return out

    def touched(self, x: int) -> int:
        """The starts of the bundles with any bit in frame mask ``x``."""
        for step in self.folds:  # bit i becomes the or of bits i .. i + tp - 1
            x |= x >> step
        return x & self.starts

    def loads(self, counts: Counts, ranks: Iterable[int]) -> dict[int, int]:
        """rank -> ``counts`` summed over ``spec.bundle(rank)``."""
        levels = [self.local(level) for level in counts.levels]
        counted = self.touched(levels[0]) if levels else 0  # bundles with any count
        tp, block, dp = self.tp, self.block, self.dp
        out: dict[int, int] = {}
        for r in ranks:
            total = 0
            if 0 <= r < dp:  # per position, so a device listed twice counts twice
                if counted >> (r * tp) & 1:
                    for level in levels:
                        total += (level >> (r * tp) & block).bit_count()
            else:
                for d in self._bundle(r):
                    total += counts.within(1 << self._devices.bit(d))
            out[r] = total
        return out

    def count(self, counts: Counts, starts: int) -> None:
        """Add every device of these ranks' bundles to ``counts``."""
        if self.offset is not None:
            counts.add(self.spread(starts * self.block))
            return
        for r in self.ranks(starts):  # a device listed twice counts twice
            for d in self._bundle(r):
                counts.add(1 << self._devices.bit(d))


def frame_of(spec: ClusterSpec, devices: Devices) -> Frame:
    """``Frame(spec, devices)``; for a spec whose devices are a range of ids, one
    frame shared by every plan (a frame is a function of the device tuple, tp and the
    cluster size; it reads no spare bit of ``devices``)."""
    hit = FRAMES.get(id(spec.devices))  # the entry holds the tuple: its id stays its own
    if hit is not None and hit.listed is spec.devices and hit.tp == spec.tp and hit.n == devices.n:
        return hit
    return new_frame(spec, devices)


def new_frame(spec: ClusterSpec, devices: Devices) -> Frame:
    """``Frame(spec, devices)``, kept for frame_of() where it has units."""
    frame = Frame(spec, devices)
    if frame.units is not None:
        frame._devices = _devices(devices.n)  # not this plan's
        if len(FRAMES) >= FRAMES_MAX:
            FRAMES.clear()
        FRAMES[id(spec.devices)] = frame
    return frame


FRAMES: dict[int, Frame] = {}
FRAMES_MAX = 512
_MEMO_MAX = 1024  # Frame.summed: rank sets remembered per dp and tp
_NO_MEMO: dict[bytes, int] = {}  # (of a frame without units: never read)
_RUNS = 200  # Devices.listed: at most this many runs (twice) are found run by run
_LISTED: tuple[int, int, tuple[int, ...]] = (-1, 0, ())  # its last answer: n, mask, devices


class Counts:
    """A multiset of devices, bit-sliced: ``levels[k]`` holds the devices counted
    more than ``k`` times."""

    __slots__ = ("levels",)

    def __init__(self) -> None:
        self.levels: list[int] = []

    def add(self, mask: int) -> None:
        """Count every device of ``mask`` once more."""
        carry = mask
        for k, level in enumerate(self.levels):
            self.levels[k] = level | carry
            carry &= level
            if not carry:
                return
        self.levels.append(carry)

    def within(self, mask: int) -> int:
        """The counts of the devices of ``mask``, summed."""
        return sum((level & mask).bit_count() for level in self.levels)

    def support(self) -> int:
        """The devices counted at least once."""
        return self.levels[0] if self.levels else 0


@lru_cache(maxsize=64)
def _ids(n: int) -> tuple[int, ...]:
    return tuple(range(n))


@lru_cache(maxsize=64)
def _devices(n: int) -> Devices:
    """A cluster of ``n`` devices for frames that outlive a plan (they give it no spare bit)."""
    return Devices(n)


@lru_cache(maxsize=1024)
def _layout(size: int, tp: int) -> tuple[Any, ...]:
    """For ``size`` devices in bundles of ``tp``: tp, dp, dp*tp, one bundle's bits,
    every bundle's first bit, all the bits, the shifts that or each bit with the
    ``tp - 1`` above it (the window doubles, then tops up); then each rank's bundle
    (its bits), followed by dp NaNs (ranks dp .. 2 dp - 1: a float, so a sum over
    them is no int), and an empty memory for Frame.summed()."""
    dp = size // tp
    starts = int(("0" * (tp - 1) + "1") * dp, 2) if dp else 0
    folds, width = [], 1
    while width < tp:
        folds.append(min(width, tp - width))
        width += folds[-1]
    block = (1 << tp) - 1
    units = (*[block << (r * tp) for r in range(dp)], *[math.nan] * dp)
    return tp, dp, dp * tp, block, starts, (1 << (dp * tp)) - 1, tuple(folds), units, {}


def _flags(x: int, width: int) -> bytes:
    """Bits ``0 .. width - 1`` of ``x``, one byte (0 or 1) each."""
    return format(x, f"0{width}b")[::-1].encode().translate(_BIT) if width else b""
