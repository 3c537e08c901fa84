"""The slot header of the weight cache: a seqlock, and the memory fences it needs.

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
"""

from __future__ import annotations

import ctypes
import platform
import struct
from collections.abc import Callable

HEADER = 4096  # slot header bytes; data starts here (page aligned)
# Header: magic at 0, the generation at 8 (8-byte aligned: loaded and stored
# atomically, never through struct), then data bytes, version (-1: none), layout.
_MAGIC_FIELD = struct.Struct("<8s")
_GENERATION_AT = 8
_FIELDS = struct.Struct("<Qq16s")
_FIELDS_AT = 16
_MAGIC = b"RLIXSLOT"
_NO_VERSION = -1

# --- memory ordering (see the module docstring) ----------------------------------------

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
