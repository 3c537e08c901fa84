"""Fences: devices a shard worker may still hold (docs/SCHEDULING.md, "Fenced leases").

:class:`FenceTable` is the registry's ``fences``: a mapping from ``(pipeline, rank)`` to
its :class:`Fence`, indexed by device. At 4,096 devices hundreds of fences stand at once,
and every grant and wake asks which of them cover its devices: the index answers that
in the size of the question, not of the table. The table also remembers which keys
changed since the coordinator last journaled them, so journaling a lifted fence does
not compare the whole table either.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from rlix_async.protocols.topology import INFER

FenceKey = tuple[str, int]  # (pipeline, rank)


@dataclass
class Fence:
    """Devices a shard worker may still hold: not planned, not granted, until lifted."""

    pipeline: str
    rank: int
    devices: tuple[int, ...]
    holder: str | None  # the worker incarnation ("host:pid") that may hold them
    reason: str
    since: float

    def __str__(self) -> str:
        who = self.holder or "no worker"
        return f"{self.pipeline}/{INFER}[{self.rank}] ({who}): {self.reason}"


class FenceTable(Mapping[FenceKey, Fence]):
    """Fences by ``(pipeline, rank)``, with a device index and a record of changed keys.
    Every change goes through ``[key] = fence``, :meth:`pop` or :meth:`clear`; a fence's
    devices never change once it is set (only its holder and reason do)."""

    def __init__(self) -> None:
        self._fences: dict[FenceKey, Fence] = {}
        self._by_device: dict[int, set[FenceKey]] = {}
        self._changed: set[FenceKey] = set()

    def __getitem__(self, key: FenceKey) -> Fence:
        return self._fences[key]

    def __iter__(self) -> Iterator[FenceKey]:
        return iter(self._fences)

    def __len__(self) -> int:
        return len(self._fences)

    def __contains__(self, key: object) -> bool:
        return key in self._fences

    def __setitem__(self, key: FenceKey, fence: Fence) -> None:
        if key in self._fences:
            self._unindex(key, self._fences[key])
        self._fences[key] = fence
        for d in fence.devices:
            self._by_device.setdefault(d, set()).add(key)
        self._changed.add(key)

    def pop(self, key: FenceKey, *default: Fence | None) -> Fence | None:
        """Lift the fence on ``key`` and return it (``default`` when there is none)."""
        f = self._fences.pop(key, None)
        if f is None:
            if default:
                return default[0]
            raise KeyError(key)
        self._unindex(key, f)
        self._changed.add(key)
        return f

    def clear(self) -> None:
        self._changed.update(self._fences)
        self._fences.clear()
        self._by_device.clear()

    def _unindex(self, key: FenceKey, fence: Fence) -> None:
        for d in fence.devices:
            keys = self._by_device[d]
            keys.discard(key)
            if not keys:
                del self._by_device[d]

    def covering(self, devices: Iterable[int]) -> list[Fence]:
        """The fences on any of ``devices``, by key."""
        keys: set[FenceKey] = set()
        for d in devices:
            keys.update(self._by_device.get(d, ()))
        return [self._fences[k] for k in sorted(keys)]

    def devices(self) -> set[int]:
        """Every fenced device."""
        return set(self._by_device)

    def take_changed(self) -> set[FenceKey]:
        """The keys set or lifted since the last call (each may have been both)."""
        changed, self._changed = self._changed, set()
        return changed
