"""What every engine's version load does, whatever the engine and the transport.

- :func:`stage_version`: a consistent private copy of a version (from any transport),
  for loads that must not touch the model before the whole version is here (a stream
  can break halfway) and for adapters.
- :func:`load_leased`: on the owner's node, a load straight from the mapped slot under
  a reader's lease, no private copy, checked by the seqlock before and after.

Both follow the owner when it moved on: a slot rewritten before or during the read is
retried from the version the slot holds now (the ref returned names the version
loaded), so a receiver never loads a mixture and never fails a sync because the
trainer was fast.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SlotOverwritten, SyncError
from rlix_async.security import ClientKeys
from rlix_async.weights.shm import SHM_DIR, current_slot_ref
from rlix_async.weights.transports import pull_blocking
from rlix_async.weights.transports.shm import SharedMemory

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 20
Named = list[tuple[str, torch.Tensor]]


class StagingSink:
    """Private copies of a version's tensors."""

    def __init__(self) -> None:
        self.named: Named = []

    def start(self, version: int, layout: Layout) -> None:
        self.named = []

    def load(self, named: Named) -> None:
        self.named.extend((name, t.clone()) for name, t in named)

    def finish(self, version: int) -> None:
        pass

    def abort(self) -> None:
        self.named = []


def stage_version(
    ref: CacheRef,
    layout: Layout | None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> tuple[CacheRef, Layout, Named]:
    """A consistent private copy of the version ``ref`` names, by its transport. If the
    owner overwrote the slot meanwhile, the copy is retried from the newer version the
    slot holds (the returned ref names the version copied)."""
    for _ in range(MAX_ATTEMPTS):
        staged = StagingSink()
        try:
            layout = pull_blocking(ref, staged, layout, keys=keys, shm_dir=shm_dir)
        except SlotOverwritten as exc:
            logger.warning("%s; copying what the slot holds now", exc)
            time.sleep(0.01)
            ref = current_slot_ref(ref, shm_dir) or ref
            continue
        return ref, layout, staged.named
    raise SyncError(f"no consistent version of {ref.pipeline} after {MAX_ATTEMPTS} tries")


def load_leased(
    ref: CacheRef,
    layout: Layout | None,
    load: Callable[[Iterable[tuple[str, torch.Tensor]]], None],
    shm_dir: Path = SHM_DIR,
) -> tuple[CacheRef, Layout]:
    """``load`` every tensor of ``ref``'s version straight from the owner's mapped slot
    (views, valid only during the call) while a reader's lease holds it. Returns the ref
    loaded (newer than asked if the owner had moved on) and its layout. A lease that
    expired under a hung load is caught by the seqlock after it, and the load is redone
    from the version the slot holds then: the caller's engine must not serve in between."""
    transport = SharedMemory(shm_dir)
    for _ in range(MAX_ATTEMPTS):
        with transport.leased(ref, layout) as slot:
            try:
                slot.check("before")
            except SlotOverwritten as exc:  # moved on before our lease: follow it
                logger.info("%s; loading what the slot holds now", exc)
                ref = slot.current() or ref
                continue
            layout = slot.layout
            load(slot.named())
            try:
                slot.check("during")
            except SlotOverwritten as exc:  # our lease expired mid-load
                logger.warning("%s; loading the version the slot holds now", exc)
                ref = slot.current() or ref
                continue
            return ref, layout
        time.sleep(0.01)  # (only after a 'continue': the slot was being written)
    raise SyncError(f"no consistent version of {ref.pipeline} after {MAX_ATTEMPTS} tries")
