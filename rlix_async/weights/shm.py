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

Memory ordering. A seqlock is only correct if the generation and the data are
seen in the order they were written. x86 keeps stores in order and loads in
order, ARM (GH200's Grace) does not, so both sides issue full fences:

- writer (:func:`write_header`): store the odd generation, fence, write header
  fields and data; then fence (release), store the even generation;
- reader (:func:`read_header`, called before and after the copy): fence, load
  the generation, fence, header fields, fence, load it again, fence. The first
  fence orders the copy's loads before the re-read; the last one orders the
  first read before the copy's loads.

The fence is libatomic's ``atomic_thread_fence(memory_order_seq_cst)``, called
through ctypes: an exported function, so no compiler is needed at runtime, and
a full barrier (``lock or`` on x86-64, ``dmb ish`` on aarch64). libatomic
(Debian/Ubuntu ``libatomic1``) ships with GCC's runtime on mainstream
distributions. The generation is loaded and stored with libatomic's
``__atomic_load_8`` / ``__atomic_store_8``: the struct module reads and writes
integers byte by byte, so a reader racing a writer could see half a counter.
Without libatomic, x86-64 falls back to its hardware order (a no-op fence and
one aligned 8-byte move through ctypes); on any other machine importing this
module fails, naming the package to install. :data:`ORDER` counts its fences.

Space. Slots are reserved with ``posix_fallocate`` when created: a directory
too small for them fails with :class:`ShmSpaceError` at once, instead of the
owner dying of SIGBUS at the first write past the end of a tmpfs (containers
give ``/dev/shm`` 64 MiB unless told otherwise).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import logging
import mmap
import os
import platform
import re
import stat
import struct
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path

import msgspec
import torch

from rlix_async.weights.packing import Layout, buckets_of
from rlix_async.weights.ref import CacheRef
from rlix_async.weights.sinks import SlotOverwritten, SyncError, WeightSink

log = logging.getLogger(__name__)
SHM_DIR = Path(os.environ.get("RLIX_SHM_DIR", "/dev/shm"))
HEADER = 4096  # slot header bytes; data starts here (page aligned)
# Header: magic at 0, the generation at 8 (8-byte aligned: loaded and stored
# atomically, never through struct), then data bytes, version (-1: none), layout.
_MAGIC_FIELD = struct.Struct("<8s")
_GENERATION_AT = 8
_FIELDS = struct.Struct("<Qq16s")
_FIELDS_AT = 16
_MAGIC = b"RLIXSLOT"
_NO_VERSION = -1
_SAFE = re.compile(r"[^A-Za-z0-9_.\-]")
MIB = 1 << 20
_SPACE_FIX = (
    "give the container more shared memory (docker run --shm-size=...) "
    "or point RLIX_SHM_DIR at a directory with room"
)

# --- memory ordering for the seqlock (see the module docstring) ----------------------

_SEQ_CST = 5  # memory_order_seq_cst (C11) == __ATOMIC_SEQ_CST (GCC)
_X86_64 = {"x86_64", "amd64"}  # 32-bit x86 has no single 8-byte move: not accepted


class MemoryOrder:
    """Full fences and single-copy atomic 64-bit loads and stores, from libatomic.

    ``machine`` is ``platform.machine()``; ``libatomic`` the library to load
    (None: none). Without a usable libatomic only x86-64 is accepted: its
    hardware keeps loads and stores in order, which is what the seqlock needs.
    """

    def __init__(self, machine: str, libatomic: str | None) -> None:
        self.fences = 0  # fences issued so far (tests check the header paths issue them)
        self._fence_fn: Callable[[int], None] | None = None
        self._load: Callable[[int, int], int] | None = None
        self._store: Callable[[int, int, int], None] | None = None
        lib = _load_library(libatomic)
        if lib is not None:
            # getattr: a dotted __name inside a class body would be name-mangled
            fence = lib.atomic_thread_fence
            load, store = getattr(lib, "__atomic_load_8"), getattr(lib, "__atomic_store_8")
            fence.argtypes, fence.restype = [ctypes.c_int], None
            load.argtypes, load.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_uint64
            store.argtypes, store.restype = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int], None
            self._fence_fn, self._load, self._store = fence, load, store
            self.source = f"{libatomic}: atomic_thread_fence, __atomic_load_8/__atomic_store_8"
        elif machine.lower() in _X86_64:
            self.source = f"{machine} hardware order (no libatomic: fences are no-ops)"
        else:
            raise ImportError(
                f"rlix_async.weights.shm: no memory fence on {machine}: the weight cache's "
                "seqlock needs libatomic (install libatomic1 with apt, libatomic with dnf)"
            )

    def fence(self) -> None:
        """A full memory barrier: no load or store moves across it, on any CPU."""
        self.fences += 1
        if self._fence_fn is not None:
            self._fence_fn(_SEQ_CST)

    def load_u64(self, buf: memoryview, offset: int) -> int:
        """One atomic load of the aligned native-order uint64 at ``buf[offset]``."""
        if self._load is None:  # ctypes' c_uint64 reads with one aligned 8-byte move
            return int(ctypes.c_uint64.from_buffer(buf, offset).value)
        return int(self._load(ctypes.addressof(ctypes.c_char.from_buffer(buf, offset)), _SEQ_CST))

    def store_u64(self, buf: memoryview, offset: int, value: int) -> None:
        """One atomic store of an aligned native-order uint64 at ``buf[offset]``."""
        if self._store is None:
            ctypes.c_uint64.from_buffer(buf, offset).value = value
            return
        self._store(ctypes.addressof(ctypes.c_char.from_buffer(buf, offset)), value, _SEQ_CST)


def _load_library(name: str | None) -> ctypes.CDLL | None:
    if name is None:
        return None
    try:
        lib = ctypes.CDLL(name)
    except OSError:
        return None
    # atomic_thread_fence is exported since libatomic 1.2 (GCC 7)
    return lib if hasattr(lib, "atomic_thread_fence") else None


ORDER = MemoryOrder(platform.machine(), "libatomic.so.1")


# --- segments ----------------------------------------------------------------------------


class ShmSpaceError(OSError):
    """The shared-memory directory has no room for the weight cache's segments."""


class ShmSecurityError(PermissionError):
    """A segment or shared-memory directory another user could have written."""


def check_shm_dir(shm_dir: Path) -> None:
    """Refuse a directory where another user could plant or swap our segments: it must
    be ours and writable by us only, or sticky like /dev/shm (whose files only their
    owner may remove or rename; each segment's owner and mode are checked on open)."""
    st = os.stat(shm_dir)
    mode = stat.S_IMODE(st.st_mode)
    if mode & stat.S_ISVTX:
        return
    if st.st_uid != os.getuid() or mode & 0o022:
        raise ShmSecurityError(
            f"{shm_dir} (RLIX_SHM_DIR) has owner uid {st.st_uid} and mode {mode:o}: other "
            "users could write weight segments there; use a directory of ours (chmod 700) "
            "or a sticky one like /dev/shm"
        )


def _safe(part: str) -> str:
    return _SAFE.sub("_", part)


def pipeline_prefix(pipeline: str) -> str:
    """Names that no other pipeline's (``a/b`` vs ``a_b``, ``a`` vs ``a-b``), user's or
    job's (``RLIX_JOB``, which the launcher sets per run directory) can share."""
    job = os.environ.get("RLIX_JOB", "")
    tag = hashlib.sha1(f"{job}/{pipeline}".encode()).hexdigest()[:10]
    return f"rlix-{os.getuid()}-{_safe(pipeline)}-{tag}-"


def segment_prefix(pipeline: str, owner: str) -> str:
    return f"{pipeline_prefix(pipeline)}{_safe(owner)}-"


def layout_segment_name(pipeline: str, owner: str, fingerprint: str) -> str:
    return f"{segment_prefix(pipeline, owner)}layout-{fingerprint}"


def ensure_room(shm_dir: Path, sizes: Sequence[int], what: str) -> None:
    """Fail with one line unless ``shm_dir`` has room for files of these sizes.

    A filesystem that reports no size (an unlimited tmpfs: ``size=0``) passes.
    """
    st = os.statvfs(shm_dir)
    if st.f_blocks == 0:
        return
    unit = st.f_frsize or st.f_bsize
    need = sum(-(-max(size, 1) // unit) * unit for size in sizes)
    free = st.f_bavail * unit
    if need > free:
        whole = (st.f_blocks - st.f_bavail) * unit + need  # what the directory must hold
        raise ShmSpaceError(
            f"{shm_dir}: {free / MIB:.1f} MiB free, {what} needs {need / MIB:.1f} MiB "
            f"({whole / MIB:.0f} MiB in all with what is there); {_SPACE_FIX}"
        )


class Segment:
    """A named shared-memory file mapped into this process.

    Created segments are reserved in full (``posix_fallocate``), so writing to
    one can never hit the end of a full tmpfs (SIGBUS); a segment that does not
    fit raises :class:`ShmSpaceError` and leaves no file behind.
    """

    def __init__(
        self, name: str, size: int = 0, *, create: bool = False, shm_dir: Path = SHM_DIR
    ) -> None:
        self.name = name
        self.path = shm_dir / name
        check_shm_dir(shm_dir)
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            if create:
                _reserve(fd, self.path, max(size, 1))
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                raise ShmSecurityError(
                    f"{self.path}: owner uid {st.st_uid}, mode "
                    f"{stat.S_IMODE(st.st_mode):o}; a weight segment must be ours and 0600"
                )
            self.size, self.inode = st.st_size, st.st_ino
            # MAP_POPULATE: fault the whole mapping in one call rather than page
            # by page during the first copy.
            self.mm = mmap.mmap(
                fd, self.size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            )
        except BaseException:
            if create:
                self.path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.buf = memoryview(self.mm)
        self._pinned = False

    @property
    def pinned(self) -> bool:
        """Page-locked for CUDA copies (cudaHostRegister succeeded)."""
        return self._pinned

    def pin(self) -> None:
        """Page-lock for fast copies between the slot and CUDA devices (only with CUDA).

        Portable: pinned for every CUDA device of this process, not only the current one.
        """
        if not torch.cuda.is_available() or self._pinned:
            return
        self._ptr = ctypes.addressof(ctypes.c_char.from_buffer(self.mm))
        cuda_host_register_portable = 1
        rc = torch.cuda.cudart().cudaHostRegister(self._ptr, self.size, cuda_host_register_portable)
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


def _reserve(fd: int, path: Path, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise ShmSpaceError(
            f"{path.parent}: no room for {path.name} ({size / MIB:.1f} MiB); {_SPACE_FIX}"
        ) from None


# --- the slot header: a seqlock ------------------------------------------------------


def read_header(buf: memoryview) -> tuple[int, int | None, str]:
    """(generation, version or None, layout fingerprint) of a slot: the reader's side.

    The header is read as a seqlock too: generation, fields, generation again. A
    read that raced a write reports the slot as being written (an odd generation,
    no version): ``struct`` zero-fills fields before writing them, so they may be
    torn. The generation reads are fenced on both sides, so they also order
    against the caller's data copies: after every load made before this call (the
    seqlock's re-read) and before every load made after it (the first read).
    ``buf`` must be writable (ctypes takes its address).
    """
    ORDER.fence()
    first = ORDER.load_u64(buf, _GENERATION_AT)
    ORDER.fence()
    (magic,) = _MAGIC_FIELD.unpack_from(buf, 0)
    _, version, fp = _FIELDS.unpack_from(buf, _FIELDS_AT)
    ORDER.fence()
    gen = ORDER.load_u64(buf, _GENERATION_AT)
    ORDER.fence()
    if gen != first or gen % 2:
        return gen | 1, None, ""
    if magic != _MAGIC:
        raise ValueError("not a weight slot")
    return gen, None if version == _NO_VERSION else version, fp.rstrip(b"\0").decode()


def write_header(
    buf: memoryview, gen: int, data_bytes: int, version: int | None, fingerprint: str
) -> None:
    """The writer's side. An odd ``gen`` opens a write: the generation is stored, then
    a fence, so no reader can see new data under the old generation. An even one
    publishes: the fields (and the data written before) are fenced before it."""
    v = _NO_VERSION if version is None else version
    if gen % 2:
        ORDER.store_u64(buf, _GENERATION_AT, gen)
        ORDER.fence()
    _MAGIC_FIELD.pack_into(buf, 0, _MAGIC)
    _FIELDS.pack_into(buf, _FIELDS_AT, data_bytes, v, fingerprint.encode()[:16])
    if not gen % 2:
        ORDER.fence()
        ORDER.store_u64(buf, _GENERATION_AT, gen)


def remove_pipeline_segments(pipeline: str, shm_dir: Path = SHM_DIR) -> None:
    """Every segment of ``pipeline``, whatever its owner (a launcher's final cleanup)."""
    for path in shm_dir.glob(pipeline_prefix(pipeline) + "*"):
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


def _framed_layout(layout: Layout) -> bytes:
    data = msgspec.msgpack.encode(layout)
    return len(data).to_bytes(8, "little") + data


def layout_segment_bytes(layout: Layout) -> int:
    """Size of the segment :func:`publish_layout` creates for ``layout``."""
    return len(_framed_layout(layout))


def publish_layout(pipeline: str, owner: str, layout: Layout, shm_dir: Path = SHM_DIR) -> Segment:
    """The owner writes a layout once, for same-node readers (length first: padded file)."""
    framed = _framed_layout(layout)
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
    """Slots are mapped once per process and reused by every later sync.

    In a process that already uses CUDA the mapping is page-locked too, so a sink
    copying into device tensors reads it by DMA; other processes are left without
    a CUDA context (it would cost device memory).
    """
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
        if torch.cuda.is_initialized():
            seg.pin()
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
    """Load ``ref`` from the owner's shared memory. Returns the layout (keep it).

    The seqlock's second read follows the last ``sink.load``, so a sink must have
    finished reading the views it was given when ``load`` returns.
    """
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
