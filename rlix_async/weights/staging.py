"""What every engine's version load does, whatever the engine and the transport.

- :func:`load_version`: the whole version into an engine's ``load`` callable, by the
  transport ``weights/transports/`` chooses: straight from the mapped slot where the
  transport maps one (:func:`load_leased`), else from a private copy
  (:func:`stage_version`); :func:`fetch_version` is its first half, for engines
  whose ranks must all hold the copy before any loads it.
- :func:`stage_version`: a consistent private copy of a version (from any transport),
  for loads that must not touch the model before the whole version is here (a stream
  can break halfway) and for adapters.
- :func:`load_leased`: on the owner's node, a load straight from the mapped slot under
  a reader's lease, no private copy, checked by the seqlock before and after.

Each follows the owner when it moved on: a slot rewritten before or during the read is
retried from the version the slot holds now (the ref returned names the version
loaded), so a receiver never loads a mixture and never fails a sync because the
trainer was fast.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

import torch

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SlotOverwritten, SyncError
from rlix_async.protocols.weight_transport import MappedTransport, WeightTransport
from rlix_async.security import ClientKeys
from rlix_async.weights.shm import SHM_DIR, layout_for
from rlix_async.weights.transports import transport_for
from rlix_async.weights.transports.node import NodeCached
from rlix_async.weights.transports.shm import SharedMemory

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 20
Named = list[tuple[str, torch.Tensor]]
# An engine's load: every tensor of one version into its model, reading each view only
# during the call (on the leased path they are the owner's mapped memory).
Load = Callable[[Iterable[tuple[str, torch.Tensor]]], None]


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


class Fetched(NamedTuple):
    ref: CacheRef  # the version fetched: newer than asked if the owner had moved on
    layout: Layout  # keep it for the next version of the same model
    staged: Named | None  # the private copy still to load (None: loaded, or in place)
    staged_bytes: int  # the private copy's size (0: read in place from the mapped slot)
    # a version on this node's cache still to load in place (:func:`load_fetched`)
    mapped: CacheRef | None = None

    @property
    def loaded(self) -> bool:
        """Whether the model holds it already (nothing staged, nothing left mapped)."""
        return self.staged is None and self.mapped is None


def fetch_version(
    ref: CacheRef,
    layout: Layout | None,
    load: Load,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Fetched:
    """The first half of :func:`load_version`, for an engine whose ranks must all have
    a version before any of them loads it (a tensor-parallel shard: one rank's failed
    transfer must leave every rank on the old weights). Where the chosen transport
    maps the slot (the owner's node) ``load`` reads it in place now, as there is no
    transfer to fail; elsewhere the whole version is copied and returned, not loaded.
    Raises SyncError (one line) when no consistent version could be had."""
    transport = transport_for(ref, keys=keys, shm_dir=shm_dir)
    if isinstance(transport, NodeCached):
        # the network part first, on every rank, loading nothing: the node's receiver
        # pulls the version (or fails, and then every rank fails alike); the version
        # is read in place from the node's slot by :func:`load_fetched`
        local = transport.here(ref)
        return Fetched(local, layout_for(local, layout, shm_dir), None, 0, mapped=local)
    if isinstance(transport, MappedTransport):
        ref, layout = load_leased(ref, layout, load, transport=transport)
        return Fetched(ref, layout, None, 0)
    ref, layout, named = _staged(transport, ref, layout)
    return Fetched(ref, layout, named, sum(t.numel() * t.element_size() for _, t in named))


def load_version(
    ref: CacheRef,
    layout: Layout | None,
    load: Load,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> Fetched:
    """Every tensor of ``ref``'s version into ``load``, by the transport chosen for the
    ref. Where that transport maps the slot (the owner's node) ``load`` reads it in
    place under a lease, and is called again with the newer version if the lease
    expired under it (the engine must not serve in between); elsewhere ``load`` gets a
    private copy, once, after the whole version arrived, so a failed transfer never
    reaches the model. Raises SyncError (one line) with ``load`` not called, or not
    completed, when no consistent version could be had."""
    return load_fetched(fetch_version(ref, layout, load, keys=keys, shm_dir=shm_dir), load, shm_dir)


def load_fetched(fetched: Fetched, load: Load, shm_dir: Path = SHM_DIR) -> Fetched:
    """The second half: load what :func:`fetch_version` left to load (a private copy,
    or a version on this node's cache, read in place under a lease and followed if the
    node's slot moved on). Returns what was loaded, with no copy kept alive."""
    if fetched.staged is not None:
        load(fetched.staged)
    if fetched.mapped is not None:
        ref, layout = load_leased(fetched.mapped, fetched.layout, load, shm_dir)
        return Fetched(ref, layout, None, 0)
    return fetched._replace(staged=None)


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
    return _staged(transport_for(ref, keys=keys, shm_dir=shm_dir), ref, layout)


def _staged(
    transport: WeightTransport, ref: CacheRef, layout: Layout | None
) -> tuple[CacheRef, Layout, Named]:
    """The copy loop of :func:`stage_version`, on the transport chosen for ``ref``
    (a newer version of the same slot comes the same way)."""
    for _ in range(MAX_ATTEMPTS):
        staged = StagingSink()
        try:
            layout = transport.pull_blocking(ref, staged, layout)
        except SlotOverwritten as exc:
            # the owner moved on (a slot rewritten, a version gone from its two
            # slots): copy what it holds now, as the leased path does
            logger.warning("%s; copying the owner's newer version", exc)
            time.sleep(0.01)
            ref = transport.current(ref) or ref
            continue
        return ref, layout, staged.named
    raise SyncError(f"no consistent version of {ref.pipeline} after {MAX_ATTEMPTS} tries")


def load_leased(
    ref: CacheRef,
    layout: Layout | None,
    load: Load,
    shm_dir: Path = SHM_DIR,
    *,
    transport: MappedTransport | None = None,
) -> tuple[CacheRef, Layout]:
    """``load`` every tensor of ``ref``'s version straight from the owner's mapped slot
    (views, valid only during the call) while a reader's lease holds it. Returns the ref
    loaded (newer than asked if the owner had moved on) and its layout. A lease that
    expired under a hung load is caught by the seqlock after it, and the load is redone
    from the version the slot holds then: the caller's engine must not serve in between.
    ``transport``: the mapped transport to read (default: shared memory in ``shm_dir``)."""
    mapped: MappedTransport = transport or SharedMemory(shm_dir)
    for _ in range(MAX_ATTEMPTS):
        with mapped.leased(ref, layout) as slot:
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
