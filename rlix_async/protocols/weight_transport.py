"""How a cached weight version reaches a receiver, in one place.

The owner (a pipeline's rank 0) holds each version in its two-slot shared-memory
cache and names it with a :class:`~rlix_async.protocols.cache_ref.CacheRef`; the ref's
``transport`` says how the owner serves receivers on other nodes. A receiver never
chooses for itself: ``weights/transports/__init__.py`` (``transport_for``) picks the
transport from the ref (shared memory on the owner's node, else the ref's tag), and
engines reach versions through ``weights/staging.py``. A new way to move weights
(node caches, NCCL, deltas) is a module in ``weights/transports/`` implementing this,
and a tag.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Iterator

    import torch

    from rlix_async.protocols.cache_ref import CacheRef, Layout
    from rlix_async.protocols.sinks import WeightSink


class WeightTransport(Protocol):
    """Brings the version a ``CacheRef`` names into a ``WeightSink``.

    Every member promises the same: the sink sees ``start``, ``load`` once per bucket
    (views valid only during the call) and ``finish``, and only after the transport
    has checked that what it loaded is the version the ref names (its layout, each
    bucket, the slot's seqlock generation after the last bucket). On any failure the
    sink is aborted (it keeps its old weights) and a ``SyncError`` names what went
    wrong in one line; a ``SlotOverwritten`` says the owner moved on, and the caller
    may follow it to the version the slot holds now.
    """

    name: str  # the tag a CacheRef carries for it ("shm" for the owner's node)

    async def pull(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        """``ref``'s version into ``sink``; returns its layout (keep it and pass it
        again: the next version of the same model needs no layout exchange)."""
        ...

    def pull_blocking(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        """:meth:`pull` for a caller with no running event loop in its thread (an
        engine's worker process, a staging thread), with the same promises."""
        ...

    def current(self, ref: CacheRef) -> CacheRef | None:
        """Where a receiver goes after a ``SlotOverwritten`` (blocking, no event loop
        in the caller's thread): the version the owner holds now in place of ``ref``'s,
        or None (nothing consistent or newer yet: retry later)."""
        ...


class LeasedVersion(Protocol):
    """A version mapped in place while a reader's lease holds its slot (the owner's node)."""

    ref: CacheRef
    layout: Layout

    def check(self, when: str) -> None:
        """Raise SlotOverwritten unless the slot still holds ``ref``'s version (before the
        read: the owner moved on before the lease; after: it broke an expired lease)."""
        ...

    def current(self) -> CacheRef | None:
        """The consistent version the slot holds now (None while it is being written)."""
        ...

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the version as a view of the mapped slot (no copy), valid
        while the lease is held."""
        ...


@runtime_checkable
class MappedTransport(WeightTransport, Protocol):
    """A transport whose versions can be read in place, with no private copy: a load
    from it needs no staging (``weights/staging.py`` checks for it)."""

    def leased(self, ref: CacheRef, layout: Layout | None) -> AbstractContextManager[LeasedVersion]:
        """Hold the slot of ``ref`` with a reader's lease while the block reads it: the
        owner does not rewrite it meanwhile, unless the lease outlives the owner's
        ``send_wait_s``. The yielded version is not checked: the caller calls ``check``
        before and after the read, and reads nothing of it after the block."""
        ...
