"""Versioned host weight cache in POSIX shared memory, owned by the trainer's rank 0.

Two slots (``/dev/shm/rlix-<pipeline>-<owner>-slot{0,1}``, mode 0600) hold at
most two versions: ``build(version, tensors)`` packs into the slot that does not
hold the promoted version, ``promote(version)`` makes it the one shards sync to.
Slots live as long as the model layout, so a shard maps each slot once and a
sync is a plain copy (no per-version mmap and page-table set-up, which costs as
much as the copy itself). Segment names are tied to pipeline and owner, so a
restarted owner removes what a crashed predecessor left behind. With CUDA
present the slots are page-locked (cudaHostRegister).

Each slot starts with a header: a generation counter used as a seqlock (odd
while the owner writes), the version, and the layout fingerprint. A reader
checks the generation before and after copying, so it can never load a
half-overwritten version; the owner waits for zero-copy remote sends of a slot
to finish before it overwrites that slot.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch

from rlix_async.weights.packing import Layout, layout_of, pack_into

log = logging.getLogger(__name__)
SHM_DIR = Path(os.environ.get("RLIX_SHM_DIR", "/dev/shm"))
HEADER = 4096  # slot header bytes; data starts here (page aligned)
_HDR = struct.Struct("<8sQQH")  # magic, generation, data bytes, version length
_MAGIC = b"RLIXSLOT"
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _safe(part: str) -> str:
    return _SAFE.sub("_", part)


def segment_prefix(pipeline: str, owner: str) -> str:
    return f"rlix-{_safe(pipeline)}-{_safe(owner)}-"


class Segment:
    """A named shared-memory file mapped into this process."""

    def __init__(
        self, name: str, size: int = 0, *, create: bool = False, shm_dir: Path = SHM_DIR
    ) -> None:
        self.name = name
        self.path = shm_dir / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, max(size, 1))
            st = os.fstat(fd)
            self.size, self.inode = st.st_size, st.st_ino
            # MAP_POPULATE: fault the whole mapping in one call rather than page
            # by page during the first copy.
            self.mm = mmap.mmap(
                fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        finally:
            os.close(fd)
        self.buf = memoryview(self.mm)
        self._pinned = False

    def pin(self) -> None:
        """Page-lock for fast host->device copies (only with CUDA)."""
        if not torch.cuda.is_available() or self._pinned:
            return
        import ctypes

        self._ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        rc = torch.cuda.cudart().cudaHostRegister(self._ptr, self.size, 0)
        if int(rc) != 0:
            log.warning("cudaHostRegister(%s) failed with %s; staying pageable", self.name, rc)
            return
        self._pinned = True

    def close(self) -> bool:
        """Unmap; False while a view (e.g. a frame being sent) still uses the memory."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self._pinned = False
        try:
            self.buf.release()
            self.mm.close()
        except BufferError:
            return False
        return True

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def read_header(buf: memoryview) -> tuple[int, str, str]:
    """(generation, version, fingerprint) of a slot."""
    magic, gen, _, vlen = _HDR.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise ValueError("not a weight slot")
    off = _HDR.size
    version = bytes(buf[off : off + vlen]).decode()
    fingerprint = bytes(buf[off + 256 : off + 272]).decode()
    return gen, version, fingerprint


def _write_header(buf: memoryview, gen: int, data_bytes: int, version: str, fp: str) -> None:
    v = version.encode()[:255]
    _HDR.pack_into(buf, 0, _MAGIC, gen, data_bytes, len(v))
    off = _HDR.size
    buf[off : off + len(v)] = v
    buf[off + 256 : off + 272] = fp.encode()[:16].ljust(16, b"\0")


def remove_pipeline_segments(pipeline: str, shm_dir: Path = SHM_DIR) -> None:
    """Every segment of ``pipeline``, whatever its owner (a launcher's final cleanup)."""
    for path in shm_dir.glob(f"rlix-{_safe(pipeline)}-*"):
        path.unlink(missing_ok=True)


def cleanup_stale(pipeline: str, owner: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove segments a crashed owner of this pipeline left behind."""
    removed = []
    for path in shm_dir.glob(segment_prefix(pipeline, owner) + "*"):
        try:
            path.unlink()
            removed.append(path.name)
        except OSError as exc:
            log.warning("cannot remove stale segment %s: %s", path, exc)
    if removed:
        log.warning("removed %d stale weight segments: %s", len(removed), removed)
    return removed


class CacheRef(msgspec.Struct, frozen=True):
    """What a shard needs to sync a version (the layout itself travels once)."""

    pipeline: str
    owner: str
    version: str
    segment: str  # the slot holding it
    generation: int  # the slot's seqlock value for this version
    fingerprint: str
    total_bytes: int
    host: str
    server: str = ""  # the owner's WeightServer endpoint, for shards on other nodes


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
        self.slot_version: list[str | None] = [None, None]
        self.generation = [0, 0]
        self.current: str | None = None
        self._trackers: list[list[Any]] = [[], []]
        self._layout_segment: Segment | None = None
        cleanup_stale(pipeline, owner, shm_dir)

    @property
    def versions(self) -> list[str]:
        return [v for v in self.slot_version if v is not None]

    def _slot_of(self, version: str) -> int:
        try:
            return self.slot_version.index(version)
        except ValueError:
            raise KeyError(f"version {version!r} is not cached") from None

    def build(self, version: str, tensors: Mapping[str, torch.Tensor]) -> CacheRef:
        if version in self.slot_version:
            raise ValueError(f"version {version!r} already built")
        if self.layout is None or _layout_changed(self.layout, tensors):
            self._reset(layout_of(tensors, self.bucket_bytes))
        assert self.layout is not None
        current = self.current
        keep = self.slot_version.index(current) if current in self.versions else 1
        slot = 1 - keep
        self._wait_sends(slot)
        seg, fp = self.slots[slot], self.layout.fingerprint()
        gen = self.generation[slot] + 1  # odd: readers of the old content now fail
        self.slot_version[slot] = None
        _write_header(seg.buf, gen, self.layout.total_bytes, "", fp)
        pack_into(tensors, self.layout, seg.buf[HEADER:])
        self.generation[slot] = gen + 1
        _write_header(seg.buf, gen + 1, self.layout.total_bytes, version, fp)
        self.slot_version[slot] = version
        return self.ref(version)

    def promote(self, version: str) -> CacheRef:
        self._slot_of(version)
        self.current = version
        return self.ref(version)

    def ref(self, version: str | None = None) -> CacheRef:
        version = version or self.current
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
        )

    def buffer(self, version: str) -> memoryview:
        """The packed bytes of ``version`` (all buckets back to back)."""
        assert self.layout is not None
        return self.slots[self._slot_of(version)].buf[HEADER : HEADER + self.layout.total_bytes]

    def track(self, version: str, tracker: Any) -> None:
        """Remember a zero-copy send of this version's memory (see build)."""
        slot = self._slot_of(version)
        self._trackers[slot] = [t for t in self._trackers[slot] if not t.done] + [tracker]

    def _wait_sends(self, slot: int) -> None:
        deadline = time.monotonic() + self.send_wait_s
        for tracker in self._trackers[slot]:
            left = deadline - time.monotonic()
            if not tracker.done and left > 0:
                with contextlib.suppress(Exception):
                    tracker.wait(left)
            if not tracker.done:
                raise TimeoutError(f"slot {slot} still being sent after {self.send_wait_s}s")
        self._trackers[slot] = []

    def slot_name(self, slot: int) -> str:
        return f"{segment_prefix(self.pipeline, self.owner)}slot{slot}"

    def layout_segment_name(self, fingerprint: str) -> str:
        return f"{segment_prefix(self.pipeline, self.owner)}layout-{fingerprint}"

    def _reset(self, layout: Layout) -> None:
        """A new model layout: fresh slots sized for it, and the layout published."""
        for slot in range(len(self.slots)):
            self._wait_sends(slot)
        self._drop_segments()
        self.layout = layout
        self.slots = [
            Segment(
                self.slot_name(i), HEADER + layout.total_bytes, create=True, shm_dir=self.shm_dir
            )
            for i in range(2)
        ]
        for i, seg in enumerate(self.slots):
            _write_header(seg.buf, 0, layout.total_bytes, "", layout.fingerprint())
            seg.pin()
            self.generation[i] = 0
        self.slot_version = [None, None]
        self.current = None
        data = msgspec.msgpack.encode(layout)
        framed = len(data).to_bytes(8, "little") + data  # length first: the file is padded
        self._layout_segment = Segment(
            self.layout_segment_name(layout.fingerprint()),
            len(framed),
            create=True,
            shm_dir=self.shm_dir,
        )
        self._layout_segment.buf[: len(framed)] = framed

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


def read_layout(pipeline: str, owner: str, fingerprint: str, shm_dir: Path = SHM_DIR) -> Layout:
    """A same-node shard reads the layout the owner published for this fingerprint."""
    seg = Segment(f"{segment_prefix(pipeline, owner)}layout-{fingerprint}", shm_dir=shm_dir)
    try:
        n = int.from_bytes(seg.buf[:8], "little")
        return msgspec.msgpack.decode(seg.buf[8 : 8 + n], type=Layout)
    finally:
        seg.close()
