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
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from functools import lru_cache
from itertools import chain, compress

from rlix_async.control.topology import ClusterSpec

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
        n = self.n
        text = format(mask & ((1 << n) - 1), f"0{n}b")[::-1] if n else ""
        return list(compress(range(n), text.encode().translate(_BIT)))


class Frame:
    """A generation cluster's devices as bits ``0 .. dp*tp - 1`` (see the module)."""

    __slots__ = (
        "_devices",
        "_folds",
        "_full",
        "_offset",
        "_spec",
        "block",
        "dp",
        "span",
        "starts",
        "tp",
    )

    def __init__(self, spec: ClusterSpec, devices: Devices) -> None:
        listed = spec.devices
        # dp, its bits, one bundle (at bit 0), every rank's start, every bit, or-folds
        self.tp, self.dp, self.span, self.block, self.starts, self._full, self._folds = _layout(
            len(listed), spec.tp
        )
        span = self.span
        self._spec = spec
        self._devices = devices
        self._offset: int | None = None
        if span:
            first = listed[0]
            if devices.ids[first : first + span] == (
                listed if span == len(listed) else listed[:span]
            ):
                self._offset = first

    def local(self, mask: int) -> int:
        """Cluster device mask -> frame mask."""
        if self._offset is not None:
            return (mask >> self._offset) & self._full
        bit = self._devices.bit
        out = 0
        for i, d in enumerate(self._spec.devices[: self.span]):
            out |= (mask >> bit(d) & 1) << i
        return out

    def spread(self, x: int) -> int:
        """Frame mask -> cluster device mask."""
        if self._offset is not None:
            return x << self._offset
        return self._devices.mask(compress(self._spec.devices, _flags(x, self.span)))

    def bundle(self, rank: int) -> int:
        """The devices of ``spec.bundle(rank)`` (any rank, in range or not)."""
        if self._offset is not None and 0 <= rank < self.dp:
            return self.block << (self._offset + rank * self.tp)
        return self._devices.mask(self._spec.bundle(rank))

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
        for step in self._folds:  # bit i becomes the or of bits i .. i + tp - 1
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
                for d in self._spec.bundle(r):
                    total += counts.within(1 << self._devices.bit(d))
            out[r] = total
        return out

    def count(self, counts: Counts, starts: int) -> None:
        """Add every device of these ranks' bundles to ``counts``."""
        if self._offset is not None:
            counts.add(self.spread(starts * self.block))
            return
        for r in self.ranks(starts):  # a device listed twice counts twice
            for d in self._spec.bundle(r):
                counts.add(1 << self._devices.bit(d))


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


@lru_cache(maxsize=4096)
def _layout(size: int, tp: int) -> tuple[int, int, int, int, int, int, tuple[int, ...]]:
    """For ``size`` devices in bundles of ``tp``: tp, dp, dp*tp, one bundle's bits,
    every bundle's first bit, all the bits, and the shifts that or each bit with the
    ``tp - 1`` above it (the window doubles, then tops up)."""
    dp = size // tp
    starts = int(("0" * (tp - 1) + "1") * dp, 2) if dp else 0
    folds, width = [], 1
    while width < tp:
        folds.append(min(width, tp - width))
        width += folds[-1]
    return tp, dp, dp * tp, (1 << tp) - 1, starts, (1 << (dp * tp)) - 1, tuple(folds)


def _flags(x: int, width: int) -> bytes:
    """Bits ``0 .. width - 1`` of ``x``, one byte (0 or 1) each."""
    return format(x, f"0{width}b")[::-1].encode().translate(_BIT) if width else b""
