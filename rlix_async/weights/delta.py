"""A weight version as a delta against the version before it: per bucket, the smallest
of three encodings, and its exact inverse.

At RL's learning rates most bf16 weights keep their value from one step to the next
(a bf16 element moves only when its float32 main copy crosses a rounding boundary),
so most of a version's bytes equal its predecessor's. Per bucket the owner sends
the smaller of:

- ``FULL``: the bucket as it is (a float32 cache, where nearly every element moves);
- ``SPARSE``: the changed words' indices and new values. A word is the bucket's
  smallest element (2 bytes with any bf16 tensor in it), an index as wide as the
  bucket's word count needs (2, 4 or 8 bytes);
- ``XOR_ZSTD``: the bucket XOR its base, compressed by zstd at level 1. An element
  that moved by a few ulps XORs to a word of zeros but its low bits, which zstd
  packs far below the sparse form: on bf16 updates at lr 1e-5 and 1e-6 it was
  0.19x and 0.05x the full size against sparse's 0.75x and 0.13x, and lz4's 0.34x
  and 0.10x at about the same speed (docs/PERF.md, "Weight deltas").

:func:`decode` is strict: a payload whose sizes, indices or decompressed length do
not fit the bucket raises :class:`DeltaError`; whether the base is the right one,
and the result the owner's, is the caller's check (the manifest's digests).
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from rlix_async.protocols.cache_ref import Layout
from rlix_async.weights.packing import _DTYPES

_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SPARSE_HEAD = struct.Struct("<BBQ")  # word bytes, index bytes, changed words
ZSTD_LEVEL = 1  # level 3 packed these deltas 1% smaller at 30% of the speed


class Kind(enum.IntEnum):
    FULL = 0
    SPARSE = 1
    XOR_ZSTD = 2


class DeltaError(ValueError):
    """A delta payload that does not fit its bucket."""


@dataclass(frozen=True)
class Encoded:
    """One bucket of a version, encoded against the same bucket of its base."""

    kind: Kind
    payload: bytes | memoryview  # FULL: a view of the version's own bytes, no copy
    changed: int  # words that differ from the base
    words: int  # words in the bucket
    sparse_bytes: int  # what each encoding came to (the measurements' per-encoding sizes)
    xor_zstd_bytes: int  # (nothing changed: not compressed, taken as the sparse size)


def word_bytes(layout: Layout, bucket: int) -> int:
    """The bucket's word: its smallest element (a float32 tensor beside a bf16 one is
    two words an element; never a word straddling two elements)."""
    sizes = [_DTYPES[e.dtype].itemsize for e in layout.entries if e.bucket == bucket]
    return min(sizes, default=1)


def index_bytes(words: int) -> int:
    """The index width a bucket of ``words`` words needs."""
    return 2 if words <= 1 << 16 else 4 if words <= 1 << 32 else 8


def _words(data: memoryview | bytes, word: int) -> np.ndarray:
    return np.frombuffer(data, dtype=_WORD[word])


def encode(base: memoryview | bytes, new: memoryview | bytes, word: int) -> Encoded:
    """``new`` as the smallest of FULL, SPARSE and XOR_ZSTD against ``base`` (the same
    bucket of the base version: same length)."""
    if len(base) != len(new):
        raise DeltaError(f"a {len(new)}-byte bucket against a {len(base)}-byte base")
    if len(new) % word:
        raise DeltaError(f"a {len(new)}-byte bucket is not whole {word}-byte words")
    words = len(new) // word
    lanes = 8 if len(new) % 8 == 0 else word  # XOR 8 bytes at a time where it can
    xor = np.bitwise_xor(_words(base, lanes), _words(new, lanes))
    # counted first: the indices are made only where the sparse form wins (for a float32
    # version where 95% of the words move they were 8 bytes a word, 1 GiB per 540 MB)
    changed = int(np.count_nonzero(xor.view(_WORD[word])))
    width = index_bytes(words)
    sparse_bytes = _SPARSE_HEAD.size + changed * (width + word)
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(xor.data) if changed else b""
    sizes = (sparse_bytes, len(packed) if changed else sparse_bytes)
    if packed and len(packed) < min(sparse_bytes, len(new)):
        return Encoded(Kind.XOR_ZSTD, packed, changed, words, *sizes)
    if sparse_bytes < len(new):
        changed_at = np.flatnonzero(xor.view(_WORD[word]))
        values = _words(new, word)[changed_at]
        head = _SPARSE_HEAD.pack(word, width, changed)
        index = changed_at.astype(_WORD[width], copy=False)
        payload = head + index.tobytes() + values.tobytes()
        return Encoded(Kind.SPARSE, payload, changed, words, *sizes)
    return Encoded(Kind.FULL, new, changed, words, *sizes)


def decode(
    base: memoryview | bytes, kind: int, payload: memoryview | bytes, out: memoryview
) -> None:
    """Write into ``out`` the bucket that ``payload`` (of ``kind``) makes of ``base``
    (``out`` may not be ``base``). Raises DeltaError if the payload does not fit."""
    n = len(out)
    if len(base) != n:
        raise DeltaError(f"a {n}-byte bucket against a {len(base)}-byte base")
    target = np.frombuffer(out, dtype=np.uint8)
    if kind == Kind.FULL:
        if len(payload) != n:
            raise DeltaError(f"a full bucket of {len(payload)} bytes, not {n}")
        target[:] = np.frombuffer(payload, dtype=np.uint8)
    elif kind == Kind.SPARSE:
        _apply_sparse(base, payload, out)
    elif kind == Kind.XOR_ZSTD:
        try:
            # the frame states its size (encode writes it): anything but the bucket's is
            # refused before a byte is allocated (max_output_size alone does not bound a
            # frame that names its own size: a relay could send a bomb)
            stated = zstandard.frame_content_size(payload)
            if stated != n:
                raise DeltaError(f"a zstd delta of {stated} bytes for a {n}-byte bucket")
            xor = zstandard.ZstdDecompressor().decompress(payload, max_output_size=n)
        except zstandard.ZstdError as exc:
            raise DeltaError(f"a corrupt zstd delta: {exc}") from None
        if len(xor) != n:
            raise DeltaError(f"a zstd delta of {len(xor)} bytes for a {n}-byte bucket")
        lanes = 8 if n % 8 == 0 else 1
        np.bitwise_xor(_words(base, lanes), _words(xor, lanes), out=target.view(_WORD[lanes]))
    else:
        raise DeltaError(f"unknown delta kind {kind}")


def _apply_sparse(base: memoryview | bytes, payload: memoryview | bytes, out: memoryview) -> None:
    if len(payload) < _SPARSE_HEAD.size:
        raise DeltaError("a sparse delta shorter than its header")
    word, width, changed = _SPARSE_HEAD.unpack_from(payload)
    if word not in _WORD or width not in (2, 4, 8) or len(out) % word:
        raise DeltaError(f"a sparse delta of {word}-byte words and {width}-byte indices")
    if len(payload) != _SPARSE_HEAD.size + changed * (width + word):
        raise DeltaError(f"a sparse delta of {len(payload)} bytes for {changed} changes")
    words = len(out) // word
    body = memoryview(payload)[_SPARSE_HEAD.size :]
    index = np.frombuffer(body[: changed * width], dtype=_WORD[width])
    values = np.frombuffer(body[changed * width :], dtype=_WORD[word])
    if changed and int(index.max()) >= words:
        raise DeltaError(f"a sparse delta indexes word {int(index.max())} of {words}")
    target = np.frombuffer(out, dtype=_WORD[word])
    target[:] = _words(base, word)
    target[index] = values


@dataclass(frozen=True)
class DeltaStats:
    """What a version's delta against its base came to (a step row's ``delta_*``)."""

    version: int
    base: int
    full_bytes: int
    wire_bytes: int  # the chosen encodings' payloads, all buckets
    changed: int  # words that differ, all buckets
    words: int
    kinds: tuple[int, int, int]  # buckets encoded FULL, SPARSE, XOR_ZSTD
    encode_s: float
    sparse_bytes: int  # every bucket sparse, and every bucket XOR_ZSTD (the alternatives)
    xor_zstd_bytes: int

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.words if self.words else 0.0

    @property
    def wire_per_full(self) -> float:
        return self.wire_bytes / self.full_bytes if self.full_bytes else 1.0


def stats_of(
    version: int, base: int, buckets: Sequence[Encoded], full_bytes: int, encode_s: float
) -> DeltaStats:
    kinds = [0, 0, 0]
    for b in buckets:
        kinds[b.kind] += 1
    return DeltaStats(
        version,
        base,
        full_bytes,
        sum(len(b.payload) for b in buckets),
        sum(b.changed for b in buckets),
        sum(b.words for b in buckets),
        (kinds[0], kinds[1], kinds[2]),
        encode_s,
        sum(b.sparse_bytes for b in buckets),
        sum(b.xor_zstd_bytes for b in buckets),
    )
