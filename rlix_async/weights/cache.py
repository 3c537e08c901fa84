"""Versioned host weight cache in POSIX shared memory, owned by the trainer's rank 0.

Two slots hold at most two versions: ``build(version, tensors)`` packs into
the slot that does not hold the promoted version, ``promote(version)`` makes
it the one shards sync to. Slots live as long as the model layout (see
:mod:`rlix_async.weights.shm` for the segments and :mod:`rlix_async.weights.seqlock`
for the header).
Segment names are tied to pipeline and owner, so a restarted owner removes
what a crashed predecessor left behind. With CUDA present the slots are
page-locked (cudaHostRegister) and ``build`` copies device tensors straight
into them (see :func:`~rlix_async.weights.packing.pack_into`). Before it
overwrites a slot the owner waits for zero-copy remote sends of it to finish and
for same-node readers' leases to end, each at most ``send_wait_s``.

Before it creates a layout's segments (two slots and the layout) the cache
checks its directory has room for them and fails with one line naming the
directory, the free and needed MiB and the fix (:class:`ShmSpaceError`): a
container's 64 MiB ``/dev/shm`` would otherwise kill the owner with SIGBUS.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

import torch

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import DeltaMismatch, SyncError
from rlix_async.weights.delta import DeltaError, Kind, decode
from rlix_async.weights.manifest import Manifest, ManifestSigner, bucket_digest
from rlix_async.weights.packing import layout_of, pack_into
from rlix_async.weights.seqlock import HEADER, write_header
from rlix_async.weights.shm import (
    SHM_DIR,
    Segment,
    cleanup_stale,
    ensure_room,
    layout_segment_bytes,
    publish_layout,
    segment_prefix,
)

log = logging.getLogger(__name__)


class SendTracker(Protocol):
    """A zero-copy send in progress (pyzmq's MessageTracker)."""

    @property
    def done(self) -> bool: ...
    def wait(self, timeout: float) -> None: ...


class WeightCache:
    def __init__(
        self,
        pipeline: str,
        owner: str = "rank0",
        *,
        bucket_bytes: int = 64 << 20,
        shm_dir: Path = SHM_DIR,
        send_wait_s: float = 120.0,
    ) -> None:
        self.pipeline = pipeline
        self.owner = owner
        self.bucket_bytes = bucket_bytes
        self.shm_dir = shm_dir
        self.send_wait_s = send_wait_s
        self.layout: Layout | None = None
        self.slots: list[Segment] = []
        self.slot_version: list[int | None] = [None, None]
        self.generation = [0, 0]
        self.current: int | None = None
        self._trackers: list[list[SendTracker]] = [[], []]
        self._leased = [False, False]  # whether we hold a slot's exclusive lock
        self._layout_segment: Segment | None = None
        # Set by serve(): where shards on other nodes pull from (see weights/tcp.py)
        self.server = ""
        self.server_key = ""
        self.transport = "sealed"  # how the server sends a version (weights/transports/)
        self.incarnation = uuid.uuid4().hex[:12]  # this start's (CacheRef.incarnation)
        self.signer: ManifestSigner | None = None  # made at the first manifest asked for
        self._manifests: dict[int, tuple[int, Manifest]] = {}  # slot -> (generation, it)
        cleanup_stale(pipeline, owner, shm_dir)

    @property
    def versions(self) -> list[int]:
        return [v for v in self.slot_version if v is not None]

    def _slot_of(self, version: int) -> int:
        try:
            return self.slot_version.index(version)
        except ValueError:
            raise KeyError(f"version {version} is not cached") from None

    def build(self, version: int, tensors: Mapping[str, torch.Tensor]) -> CacheRef:
        if version in self.slot_version:
            raise ValueError(f"version {version} already built")
        if self.layout is None or _layout_changed(self.layout, tensors):
            self._reset(layout_of(tensors, self.bucket_bytes))
        assert self.layout is not None
        slot = self._open_slot(version, self.layout)
        try:
            pack_into(tensors, self.layout, self.slots[slot].buf[HEADER:])
        except BaseException:
            self._close_slot(slot, None)
            raise
        self._close_slot(slot, version)
        return self.ref(version)

    def receive(
        self,
        digests: list[bytes] | None = None,
        on_open: Callable[[int, int], None] | None = None,
        on_landed: Callable[[int], None] | None = None,
        on_delta: Callable[[int, int, memoryview], None] | None = None,
    ) -> SlotWriter:
        """A sink that fills the spare slot with a version as a transport delivers it
        (a node cache's receiver): offered, and promoted, only once it is whole. With
        ``digests`` (the owner's signed manifest) each bucket is checked as it lands;
        ``on_open(slot, generation)`` and ``on_landed(bucket)`` let a relay forward
        each bucket as soon as it is here and checked, and ``on_delta(bucket, kind,
        payload)`` the delta it came as, just before (called on the writer's thread)."""
        return SlotWriter(self, digests, on_open, on_landed, on_delta)

    def _open_slot(self, version: int, layout: Layout) -> int:
        """Take the slot that does not hold the promoted version for ``version``: no
        longer offered, its sends drained, its readers' leases ended (or expired),
        its generation odd (readers of what it held now fail). Until
        :meth:`_close_slot` the caller holds it exclusively."""
        if version in self.slot_version:
            raise ValueError(f"version {version} already built")
        if self.layout is None or self.layout.fingerprint() != layout.fingerprint():
            self._reset(layout)
        current = self.current
        keep = self.slot_version.index(current) if current in self.versions else 1
        slot = 1 - keep
        # No longer offered (new remote reads of it are refused) while its sends drain.
        self.slot_version[slot] = None
        self._wait_sends(slot)
        # Same-node readers hold the slot while they read it (leases); one that holds
        # it past send_wait_s has its lease broken (see weights/shm.py).
        self._leased[slot] = self.slots[slot].lock_exclusive(self.send_wait_s)
        gen = self.generation[slot] + 1  # odd: readers of the old content now fail
        write_header(self.slots[slot].buf, gen, layout.total_bytes, None, layout.fingerprint())
        self.generation[slot] = gen
        return slot

    def _close_slot(self, slot: int, version: int | None) -> None:
        """End a write begun by :meth:`_open_slot`: the slot holds ``version`` whole
        (offered from now on), or nothing (None: the write failed)."""
        assert self.layout is not None
        gen = self.generation[slot] + 1
        write_header(
            self.slots[slot].buf, gen, self.layout.total_bytes, version, self.layout.fingerprint()
        )
        self.generation[slot] = gen
        if self._leased[slot]:
            self.slots[slot].unlock_exclusive()
            self._leased[slot] = False
        self.slot_version[slot] = version

    def promote(self, version: int) -> CacheRef:
        self._slot_of(version)
        self.current = version
        return self.ref(version)

    def serve(self, endpoint: str, public_key: str = "", transport: str = "sealed") -> None:
        """Name the WeightServer that serves this cache, and how it sends a version
        (``transport``: weights/transports/), in every ref from now on."""
        self.server, self.server_key, self.transport = endpoint, public_key, transport

    def ref(self, version: int | None = None) -> CacheRef:
        version = self.current if version is None else version
        if version is None or self.layout is None:
            raise KeyError("nothing promoted yet")
        slot = self._slot_of(version)
        return CacheRef(
            self.pipeline,
            self.owner,
            version,
            self.slots[slot].name,
            self.generation[slot],
            self.layout.fingerprint(),
            self.layout.total_bytes,
            socket.gethostname(),
            self.server,
            self.server_key,
            self.transport,
            self.incarnation,
            self.manifest_key,
        )

    @property
    def manifest_key(self) -> str:
        """The public key this cache's manifests are signed with."""
        return self._signer().public_hex

    def _signer(self) -> ManifestSigner:
        if self.signer is None:  # made on first use: a cache nobody relays never signs
            self.signer = ManifestSigner()
        return self.signer

    def manifest(self, version: int) -> Manifest:
        """The signed manifest of ``version`` (its buckets' digests), computed once per
        write of its slot. KeyError if the version left the cache meanwhile."""
        slot = self._slot_of(version)
        gen = self.generation[slot]
        cached = self._manifests.get(slot)
        if cached is not None and cached[0] == gen:
            return cached[1]
        assert self.layout is not None
        signed = self._signer().sign(self.ref(version), self.layout, self.buffer(version))
        if self.generation[slot] != gen or self.slot_version[slot] != version:
            raise KeyError(f"version {version} was rewritten while its manifest was made")
        self._manifests[slot] = (gen, signed)
        return signed

    def buffer(self, version: int) -> memoryview:
        """The packed bytes of ``version`` (all buckets back to back)."""
        return self.slot_data(self._slot_of(version))

    def slot_data(self, slot: int) -> memoryview:
        """The packed bytes ``slot`` holds or is being written with (a relay serves a
        version from there as it arrives)."""
        assert self.layout is not None
        return self.slots[slot].buf[HEADER : HEADER + self.layout.total_bytes]

    def track(self, version: int, tracker: SendTracker) -> None:
        """Remember a zero-copy send of this version's memory (see build)."""
        self.track_slot(self._slot_of(version), tracker)

    def track_slot(self, slot: int, tracker: SendTracker) -> None:
        """Remember a zero-copy send out of ``slot`` (a relay's, while it is written)."""
        self._trackers[slot] = [*(t for t in self._trackers[slot] if not t.done), tracker]

    def _wait_sends(self, slot: int) -> None:
        deadline = time.monotonic() + self.send_wait_s
        # Until none is left: a send that began just before the slot stopped being
        # offered may be tracked while we wait (track() runs on another thread).
        while pending := [t for t in list(self._trackers[slot]) if not t.done]:
            for tracker in pending:
                left = deadline - time.monotonic()
                if not tracker.done and left > 0:
                    with contextlib.suppress(Exception):
                        tracker.wait(left)
                if not tracker.done:
                    raise TimeoutError(f"slot {slot} still being sent after {self.send_wait_s}s")
        self._trackers[slot] = []

    def slot_name(self, slot: int) -> str:
        return f"{segment_prefix(self.pipeline, self.owner)}slot{slot}"

    def _reset(self, layout: Layout) -> None:
        """A new model layout: fresh slots sized for it, and the layout published."""
        for slot in range(len(self.slots)):
            self._wait_sends(slot)
        self._drop_segments()
        self.layout, self.slot_version, self.current = None, [None, None], None
        self._manifests.clear()  # generations start again: never the old layout's
        slot_bytes = HEADER + layout.total_bytes
        ensure_room(
            self.shm_dir,
            [slot_bytes, slot_bytes, layout_segment_bytes(layout)],
            f"the weight cache of pipeline {self.pipeline!r} (two slots of "
            f"{slot_bytes / (1 << 20):.1f} MiB and the layout)",
        )
        try:
            for i in range(2):
                self.slots.append(
                    Segment(self.slot_name(i), slot_bytes, create=True, shm_dir=self.shm_dir)
                )
            self._layout_segment = publish_layout(self.pipeline, self.owner, layout, self.shm_dir)
        except BaseException:  # the directory filled up meanwhile: leave nothing half made
            self._drop_segments()
            raise
        for i, seg in enumerate(self.slots):
            write_header(seg.buf, 0, layout.total_bytes, None, layout.fingerprint())
            seg.pin()
            self.generation[i] = 0
        self.layout = layout

    def _drop_segments(self) -> None:
        for seg in [*self.slots, *([self._layout_segment] if self._layout_segment else [])]:
            seg.unlink()  # mapped readers keep their pages until they unmap
            if not seg.close():
                log.warning("segment %s still referenced; unmapped at exit", seg.name)
        self.slots, self._layout_segment = [], None

    def close(self) -> None:
        for slot in range(len(self.slots)):
            with contextlib.suppress(TimeoutError):
                self._wait_sends(slot)
        self._drop_segments()
        self.slot_version = [None, None]
        self.current = None


def _layout_changed(layout: Layout, tensors: Mapping[str, torch.Tensor]) -> bool:
    if len(layout.entries) != len(tensors):
        return True
    for e in layout.entries:
        t = tensors.get(e.name)
        if t is None or tuple(t.shape) != e.shape or str(t.dtype).removeprefix("torch.") != e.dtype:
            return True
    return False


class SlotWriter:
    """Fills a cache's spare slot from a transport (a
    :class:`~rlix_async.protocols.sinks.WeightSink`): each bucket's tensors are copied
    to their places as they arrive (and, given the owner's digests, the bucket checked
    against its digest), and the version is offered and promoted only at ``finish``,
    once every bucket of the layout arrived. A stream that breaks halfway (``abort``)
    leaves that slot empty and the promoted version where it was, so readers of the
    cache never see part of a version.

    With the owner's digests it is also a :class:`~rlix_async.protocols.sinks.DeltaSink`:
    the promoted version is the base a version may arrive as deltas on (decoded from
    that slot into the one being written, each bucket then checked like any other)."""

    def __init__(
        self,
        cache: WeightCache,
        digests: list[bytes] | None = None,
        on_open: Callable[[int, int], None] | None = None,
        on_landed: Callable[[int], None] | None = None,
        on_delta: Callable[[int, int, memoryview], None] | None = None,
    ) -> None:
        self.cache = cache
        self.digests = digests
        self.on_open = on_open
        self.on_landed = on_landed
        self.on_delta = on_delta
        self._slot: int | None = None
        self._raw: torch.Tensor | None = None
        self._layout: Layout | None = None
        self._places: dict[str, tuple[int, int, int]] = {}  # name -> bucket, start, nbytes
        self._landed: set[int] = set()
        self.stopping = False  # set from another thread: the next bucket ends the pull
        self.delta_fallbacks = 0  # deltas of this writer's pulls that fell back to whole
        self.wire_bytes = 0  # what arrived, every try: encoded sizes for deltas

    def start(self, version: int, layout: Layout) -> None:
        if self.digests is not None and len(self.digests) != len(layout.bucket_sizes):
            raise SyncError(f"version {version}: the manifest does not fit the layout")
        slot = self.cache._open_slot(version, layout)
        self._slot, self._layout = slot, layout
        self._raw = torch.frombuffer(self.cache.slots[slot].buf[HEADER:], dtype=torch.uint8)
        starts = layout.bucket_offsets
        self._places = {
            e.name: (e.bucket, starts[e.bucket] + e.offset, e.nbytes) for e in layout.entries
        }
        self._landed = set()
        if self.on_open is not None:
            # the generation the slot will hold once whole (what a relay's readers check)
            self.on_open(slot, self.cache.generation[slot] + 1)

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        if self.stopping:  # the receiver is stopping: end the pull, the slot unoffered
            raise SyncError("the node's receiver is stopping")
        assert self._raw is not None and self._layout is not None, "load before start"
        buckets = set()
        for name, tensor in named:
            bucket, start, nbytes = self._places[name]
            if nbytes:
                self._raw[start : start + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
            buckets.add(bucket)
        for bucket in buckets:  # a transport hands over one whole bucket per call
            self.wire_bytes += self._layout.bucket_sizes[bucket]
            self._check_landed(bucket, SyncError)

    def _bucket(self, slot: int, bucket: int) -> memoryview:
        assert self._layout is not None
        start = HEADER + self._layout.bucket_offsets[bucket]
        return self.cache.slots[slot].buf[start : start + self._layout.bucket_sizes[bucket]]

    def _check_landed(
        self, bucket: int, error: type[SyncError], delta: tuple[int, memoryview] | None = None
    ) -> None:
        """The bucket is in the slot: checked against the owner's digest, then counted
        (and handed on: a relay's ``on_delta`` gets the delta it came as, only once it
        decoded to the owner's bytes, then ``on_landed``)."""
        assert self._slot is not None
        data = self._bucket(self._slot, bucket)
        if self.digests is not None and bucket_digest(data) != self.digests[bucket]:
            raise error(f"bucket {bucket} does not match the owner's manifest")
        if delta is not None and self.on_delta is not None:
            self.on_delta(bucket, *delta)
        self._landed.add(bucket)
        if self.on_landed is not None:
            self.on_landed(bucket)

    def retry_whole(self) -> None:
        """A delta did not decode to the owner's bytes: the version comes again whole,
        into the same slot (still unoffered), every bucket checked again as it lands.
        The slot is kept rather than reopened: a relay's streams wait on it."""
        if self._slot is None:
            raise SyncError("retry before start")
        self._landed = set()
        self.delta_fallbacks += 1

    def delta_base(self) -> int | None:
        """The version this slot's may arrive as deltas on: the promoted one, held whole
        in the other slot, where the owner's digests check each decoded bucket."""
        current = self.cache.current
        if self.digests is None or self._slot is None or current not in self.cache.versions:
            return None
        return current

    def load_delta(self, index: int, kind: int, payload: memoryview) -> None:
        """Bucket ``index`` decoded from its payload onto the base's same bucket."""
        if self.stopping:
            raise SyncError("the node's receiver is stopping")
        base = self.delta_base()
        assert base is not None and self._slot is not None, "load_delta without a base"
        error = SyncError if kind == Kind.FULL else DeltaMismatch
        try:
            decode(
                self._bucket(self.cache._slot_of(base), index),
                kind,
                payload,
                self._bucket(self._slot, index),
            )
        except DeltaError as exc:
            raise error(f"bucket {index} as a delta on version {base}: {exc}") from None
        self.wire_bytes += len(payload)
        self._check_landed(index, error, None if kind == Kind.FULL else (kind, payload))

    def finish(self, version: int) -> None:
        assert self._slot is not None and self._layout is not None, "finish before start"
        missing = len(self._layout.bucket_sizes) - len(self._landed)
        if missing:
            raise SyncError(f"version {version}: {missing} buckets never arrived")
        slot, self._slot, self._raw = self._slot, None, None
        self.cache._close_slot(slot, version)
        self.cache.promote(version)

    def abort(self) -> None:
        if self._slot is not None:
            slot, self._slot, self._raw = self._slot, None, None
            self.cache._close_slot(slot, None)
