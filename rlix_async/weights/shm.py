"""Shared memory: named segments, leases on them, and same-node reads.

The owner (:class:`~rlix_async.weights.cache.WeightCache`) writes two slots per
pipeline, ``/dev/shm/rlix-<pipeline>-<owner>-slot{0,1}`` (mode 0600), and
publishes each model layout once in its own segment. A shard on the same node
maps a slot once and reuses the mapping for every later sync: a sync is a
plain copy, with no per-version mmap and page-table set-up (which costs as
much as the copy itself). Each slot starts with a seqlock header
(:mod:`rlix_async.weights.seqlock`): a reader checks it before and after it reads.

Leases. A reader holds the slot it reads: a shared ``flock`` on the slot's file,
taken before its first check of the header and released after its last use of
the data (a vLLM shard: after the engine's loader has finished with the views).
The owner takes the exclusive lock before it rewrites a slot, so a version is
never overwritten under a reader, and a reader can hand the mapped, page-locked
bytes straight to its loader instead of copying them out first. The kernel drops
a dead reader's lease with its last file descriptor (a crash, SIGKILL); a hung
reader's lease expires: the owner waits at most its ``send_wait_s`` and then
writes anyway (and logs who held the slot). The seqlock stays as the check that
catches exactly that case: the hung reader, if it ever resumes, finds the
generation changed, and its load is redone from the version the slot holds now
before anything is served (:func:`read_slot`, ``shards/vllm/transfer.py``).

Space. Slots are reserved with ``posix_fallocate`` when created: a directory
too small for them fails with :class:`ShmSpaceError` at once, instead of the
owner dying of SIGBUS at the first write past the end of a tmpfs (containers
give ``/dev/shm`` 64 MiB unless told otherwise).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import itertools
import logging
import mmap
import os
import stat
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import torch

from rlix_async.protocols.cache_ref import CacheRef, Layout, file_part
from rlix_async.protocols.sinks import SlotOverwritten, SyncError, WeightSink
from rlix_async.weights.packing import BucketView, buckets_of
from rlix_async.weights.seqlock import HEADER, read_header

log = logging.getLogger(__name__)
SHM_DIR = Path(os.environ.get("RLIX_SHM_DIR", "/dev/shm"))
MIB = 1 << 20
_SPACE_FIX = (
    "give the container more shared memory (docker run --shm-size=...) "
    "or point RLIX_SHM_DIR at a directory with room"
)

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
    return file_part(part)


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
            os.close(fd)
            raise
        self._fd = fd  # kept open: leases are flocks on it (see the module docstring)
        self.buf = memoryview(self.mm)
        self._pinned = False
        self._readers = 0  # this process's shared leases (threads share one flock)
        self._lease_lock = threading.Lock()

    # --- leases ---------------------------------------------------------------------

    def lock_shared(self, wait_s: float) -> None:
        """Take a reader's lease: wait while the owner rewrites the slot, at most
        ``wait_s`` (then :class:`SyncError`). Leases of this process's threads share
        one flock (released with the last)."""
        with self._lease_lock:
            if self._readers == 0 and not _flock_within(self._fd, fcntl.LOCK_SH, wait_s):
                raise SyncError(
                    f"{self.name}: still being rewritten by its owner after {wait_s:.0f} s"
                )
            self._readers += 1

    def unlock_shared(self) -> None:
        with self._lease_lock:
            self._readers -= 1
            if self._readers == 0:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def read_lease(self, wait_s: float) -> Iterator[None]:
        self.lock_shared(wait_s)
        try:
            yield
        finally:
            self.unlock_shared()

    def lock_exclusive(self, wait_s: float) -> bool:
        """The owner's lease before it rewrites the slot: False if readers still held it
        after ``wait_s`` (their lease expired: the owner writes anyway, and says who)."""
        if _flock_within(self._fd, fcntl.LOCK_EX, wait_s):
            return True
        log.warning(
            "%s: still leased by %s after %.0f s; overwriting it (a reader that resumes "
            "finds its version gone and loads the new one before serving)",
            self.name,
            ", ".join(f"pid {p}" for p in lease_holders(self.inode)) or "a reader",
            wait_s,
        )
        return False

    def unlock_exclusive(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)

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
        """Unmap (and drop this process's leases); False while a view (e.g. a frame
        being sent) still uses the memory."""
        if self._pinned:
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self._pinned = False
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self.buf.release()
            self.mm.close()
        except BufferError:
            return False
        return True

    def unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _flock_within(fd: int, how: int, wait_s: float) -> bool:
    """``flock(fd, how)``, retried until it is granted or ``wait_s`` has passed (a
    blocking flock could not be bounded)."""
    deadline = time.monotonic() + wait_s
    for pause in itertools.chain((0.0005, 0.001, 0.002, 0.005), itertools.repeat(0.01)):
        try:
            fcntl.flock(fd, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
    return False  # (unreachable: the pauses never end)


def lease_holders(inode: int) -> list[int]:
    """Pids holding a flock on the file with this inode (``/proc/locks``)."""
    pids = []
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  READ 1234 00:1a:5678 0 EOF" (blocked waiters carry "->")
        if (
            len(fields) >= 6
            and fields[1] == "FLOCK"
            and fields[2] != "->"
            and fields[5].rsplit(":", 1)[-1] == str(inode)
        ):
            pids.append(int(fields[4]))
    return sorted(set(pids))


def _reserve(fd: int, path: Path, size: int) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
        raise ShmSpaceError(
            f"{path.parent}: no room for {path.name} ({size / MIB:.1f} MiB); {_SPACE_FIX}"
        ) from None


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


LEASE_WAIT_S = 120.0  # a reader waits this long at most for the owner to finish a write


class SlotRead:
    """A leased slot, as :func:`read_slot` yields it: the version's tensors as views of
    the mapped slot (page-locked where this process uses CUDA), valid while the lease
    is held, and the seqlock check."""

    def __init__(self, ref: CacheRef, layout: Layout, seg: Segment) -> None:
        self.ref, self.layout, self.seg = ref, layout, seg

    def check(self, when: str) -> None:
        """Raise :class:`SlotOverwritten` unless the slot still holds ``ref``'s version:
        before the read, if the owner moved on before the lease was granted; after it,
        only if the owner broke an expired lease."""
        gen, version, _ = read_header(self.seg.buf)
        if gen != self.ref.generation or version != self.ref.version:
            now = "a version being written" if version is None else f"version {version}"
            raise SlotOverwritten(
                f"version {self.ref.version} was overwritten {when} the sync (slot now holds {now})"
            )

    def current(self) -> CacheRef | None:
        """The consistent version the slot holds now (None while being written)."""
        gen, version, _ = read_header(self.seg.buf)
        if gen % 2 or version is None:
            return None
        return msgspec.structs.replace(self.ref, version=version, generation=gen)

    def buckets(self) -> list[BucketView]:
        return buckets_of(self.layout, self.seg.buf[HEADER : HEADER + self.layout.total_bytes])

    def named(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor of the version, bucket by bucket, as a view (no copy)."""
        for bucket in self.buckets():
            yield from bucket.tensors(self.layout)


def layout_for(ref: CacheRef, layout: Layout | None, shm_dir: Path = SHM_DIR) -> Layout:
    """``layout`` if it is the one ``ref`` was packed with, else the published one."""
    if layout is not None and layout.fingerprint() == ref.fingerprint:
        return layout
    try:
        return read_layout(ref.pipeline, ref.owner, ref.fingerprint, shm_dir)
    except FileNotFoundError:
        raise SyncError(f"layout {ref.fingerprint} is not published (owner gone?)") from None


@contextlib.contextmanager
def read_slot(
    ref: CacheRef,
    layout: Layout | None = None,
    shm_dir: Path = SHM_DIR,
    wait_s: float = LEASE_WAIT_S,
) -> Iterator[SlotRead]:
    """Hold the slot of ``ref`` (a reader's lease, see the module docstring) while the
    block reads it. The caller checks the version (``check``) before and after."""
    layout = layout_for(ref, layout, shm_dir)
    seg = mapped_slot(ref.segment, shm_dir)
    with seg.read_lease(wait_s):
        yield SlotRead(ref, layout, seg)


def sync_local(
    ref: CacheRef,
    sink: WeightSink,
    layout: Layout | None = None,
    checksums: list[int] | None = None,
    shm_dir: Path = SHM_DIR,
) -> Layout:
    """Load ``ref`` from the owner's shared memory. Returns the layout (keep it).

    The slot is leased for the whole sync; the seqlock's second read follows the last
    ``sink.load`` (a sink is done with its views when ``load`` returns, see
    :class:`WeightSink`), and ``finish`` comes only after it.
    """
    with read_slot(ref, layout, shm_dir) as slot:
        try:
            slot.check("before")
            sink.start(ref.version, slot.layout)
            for bucket in slot.buckets():
                if checksums is not None and zlib.crc32(bucket.data) != checksums[bucket.index]:
                    raise SyncError(
                        f"bucket {bucket.index} of version {ref.version}: checksum mismatch"
                    )
                sink.load(bucket.tensors(slot.layout))
            slot.check("during")  # only an expired lease lets the owner write meanwhile
            sink.finish(ref.version)
        except BaseException:
            sink.abort()
            raise
    return slot.layout
