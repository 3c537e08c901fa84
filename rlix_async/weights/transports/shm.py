"""Shared memory: the owner's node. A receiver maps the owner's slot and reads it under
a reader's lease (``weights/shm.py``): a pull copies each bucket into the sink, a
leased read hands out views with no copy at all."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import WeightSink
from rlix_async.protocols.weight_transport import LeasedVersion
from rlix_async.weights.shm import SHM_DIR, read_slot, sync_local


class SharedMemory:
    name = "shm"

    def __init__(self, shm_dir: Path = SHM_DIR) -> None:
        self.shm_dir = shm_dir

    async def pull(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        return self.pull_blocking(ref, sink, layout)

    def pull_blocking(self, ref: CacheRef, sink: WeightSink, layout: Layout | None) -> Layout:
        """No event loop needed: a memory copy under the lease."""
        return sync_local(ref, sink, layout, shm_dir=self.shm_dir)

    def leased(self, ref: CacheRef, layout: Layout | None) -> AbstractContextManager[LeasedVersion]:
        return read_slot(ref, layout, self.shm_dir)
