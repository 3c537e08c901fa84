"""Shared memory: named segments, the slot header (a seqlock), and same-node reads.

The owner (:class:`~rlix_async.weights.cache.WeightCache`) writes two slots per
pipeline, ``/dev/shm/rlix-<pipeline>-<owner>-slot{0,1}`` (mode 0600), and
publishes each model layout once in its own segment. A shard on the same node
maps a slot once and reuses the mapping for every later sync: a sync is a
plain copy, with no per-version mmap and page-table set-up (which costs as
much as the copy itself).

Each slot starts with a header: a generation counter used as a seqlock (odd
while the owner writes), the version held (-1: none) and the layout
fingerprint. A reader checks the generation before and after copying, so it
never loads a half-overwritten version.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import struct
import zlib
from pathlib import Path

import msgspec
import torch

from rlix_async.weights.packing import Layout, buckets_of
from rlix_async.weights.ref import CacheRef
from rlix_async.weights.sinks import SlotOverwritten, SyncError, WeightSink

log = logging.getLogger(__name__)
SHM_DIR = Path(os.environ.get("RLIX_SHM_DIR", "/dev/shm"))
HEADER = 4096  # slot header bytes; data starts here (page aligned)
_HDR = struct.Struct("<8sQQq16s")  # magic, generation, data bytes, version (-1: none), layout
_MAGIC = b"RLIXSLOT"
_NO_VERSION = -1
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")


def _safe(part: str) -> str:
    return _SAFE.sub("_", part)


def segment_prefix(pipeline: str, owner: str) -> str:
    return f"rlix-{_safe(pipeline)}-{_safe(owner)}-"


def layout_segment_name(pipeline: str, owner: str, fingerprint: str) -> str:
    return f"{segment_prefix(pipeline, owner)}layout-{fingerprint}"


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


def read_header(buf: memoryview) -> tuple[int, int | None, str]:
    """(generation, version or None, layout fingerprint) of a slot."""
    magic, gen, _, version, fp = _HDR.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise ValueError("not a weight slot")
    return gen, None if version == _NO_VERSION else version, fp.rstrip(b"\0").decode()


def write_header(
    buf: memoryview, gen: int, data_bytes: int, version: int | None, fingerprint: str
) -> None:
    v = _NO_VERSION if version is None else version
    _HDR.pack_into(buf, 0, _MAGIC, gen, data_bytes, v, fingerprint.encode()[:16])


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


def publish_layout(pipeline: str, owner: str, layout: Layout, shm_dir: Path = SHM_DIR) -> Segment:
    """The owner writes a layout once, for same-node readers (length first: padded file)."""
    data = msgspec.msgpack.encode(layout)
    framed = len(data).to_bytes(8, "little") + data
    seg = Segment(
        layout_segment_name(pipeline, owner, layout.fingerprint()),
        len(framed),
        create=True,
        shm_dir=shm_dir,
    )
    seg.buf[: len(framed)] = framed
    return seg


def read_layout(pipeline: str, owner: str, fingerprint: str, shm_dir: Path = SHM_DIR) -> Layout:
    """A same-node shard reads the layout the owner published for this fingerprint."""
    seg = Segment(layout_segment_name(pipeline, owner, fingerprint), shm_dir=shm_dir)
    try:
        n = int.from_bytes(seg.buf[:8], "little")
        return msgspec.msgpack.decode(seg.buf[8 : 8 + n], type=Layout)
    finally:
        seg.close()


# --- the reader side -------------------------------------------------------------------

_MAPPED: dict[Path, Segment] = {}


def mapped_slot(name: str, shm_dir: Path = SHM_DIR) -> Segment:
    """Slots are mapped once per process and reused by every later sync."""
    path = shm_dir / name
    try:
        inode = os.stat(path).st_ino
    except FileNotFoundError:
        raise SyncError(f"{name} does not exist (owner gone or restarted)") from None
    seg = _MAPPED.get(path)
    if seg is None or seg.inode != inode:  # first use, or the owner re-created it
        if seg is not None:
            seg.close()
        seg = _MAPPED[path] = Segment(name, shm_dir=shm_dir)
    return seg


def forget_mappings() -> None:
    """Unmap every slot this process mapped (before sleeping or exiting)."""
    for seg in _MAPPED.values():
        seg.close()
    _MAPPED.clear()


def current_slot_ref(ref: CacheRef, shm_dir: Path = SHM_DIR) -> CacheRef | None:
    """The consistent version the slot of ``ref`` holds now (None while being written)."""
    gen, version, _ = read_header(mapped_slot(ref.segment, shm_dir).buf)
    if gen % 2 or version is None:
        return None
    return msgspec.structs.replace(ref, version=version, generation=gen)


def sync_local(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    checksums: list[int] | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """Load ``ref`` from the owner's shared memory. Returns the layout (keep it)."""
    if layout is None or layout.fingerprint() != ref.fingerprint:
        try:
            layout = read_layout(ref.pipeline, ref.owner, ref.fingerprint, shm_dir)
        except FileNotFoundError:
            raise SyncError(f"layout {ref.fingerprint} is not published (owner gone?)") from None
    seg = mapped_slot(ref.segment, shm_dir)

    def check(when: str) -> None:
        gen, version, _ = read_header(seg.buf)
        if gen != ref.generation or version != ref.version:
            now = "a version being written" if version is None else f"version {version}"
            raise SlotOverwritten(
                f"version {ref.version} was overwritten {when} the sync (slot now holds {now})"
            )

    try:
        check("before")
        sink.start(ref.version, layout)
        data = seg.buf[HEADER : HEADER + layout.total_bytes]
        for bucket in buckets_of(layout, data):
            if checksums is not None and zlib.crc32(bucket.data) != checksums[bucket.index]:
                raise SyncError(
                    f"bucket {bucket.index} of version {ref.version}: checksum mismatch"
                )
            sink.load(bucket.tensors(layout))
        check("during")  # seqlock: unchanged generation means nothing was torn
        sink.finish(ref.version)
    except BaseException:
        sink.abort()
        raise
    return layout
