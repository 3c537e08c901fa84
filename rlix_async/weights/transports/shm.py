"""Shared memory: the owner's node. A receiver maps the owner's slot and reads it under
a reader's lease (``weights/shm.py``): a pull copies each bucket into the sink, a
leased read hands out views with no copy at all."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import WeightSink
from rlix_async.protocols.weight_transport import LeasedVersion
from rlix_async.weights.shm import SHM_DIR, current_slot_ref, read_slot, sync_local


class SharedMemory:
    """The owner's slots in ``shm_dir`` (a :class:`MappedTransport`)."""

    name = "shm"

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        self.shm_dir = shm_dir

    async def pull(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        return self.pull_blocking(ref, sink, layout)

    def pull_blocking(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        """A memory copy under the lease: no event loop, no waiting on a peer."""
        try:
            return sync_local(ref, sink, layout, shm_dir=self.shm_dir)
        except BaseException:
            # sync_local aborts what it started; this covers a slot or layout that
            # could not be reached before it started (an abort twice is harmless)
            sink.abort()
            raise

    def leased(self, ref: CacheRef, layout: Layout | None) -> AbstractContextManager[LeasedVersion]:
        return read_slot(ref, layout, self.shm_dir)

    def current(self, ref: CacheRef) -> CacheRef | None:
        """The consistent version the slot of ``ref`` holds now (None while being
        written): where a receiver goes after a ``SlotOverwritten``."""
        return current_slot_ref(ref, self.shm_dir)
