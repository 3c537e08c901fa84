"""What names a cached weight version on the wire, and the layout it is packed with:
torch-free, so the coordinator and the control messages carry them without torch."""

from __future__ import annotations

import hashlib
import re

import msgspec

# What a name in a file name may hold (anything else becomes "_"): no "/", so a name is
# one path component in the shared-memory directory, never a way out of it.
UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
_TAG = r"[0-9a-f]{10}"  # the job and pipeline hash of a segment name (weights/shm.py)


def file_part(part: str) -> str:
    """``part`` as a piece of a file name: every character outside [A-Za-z0-9_.-] as _."""
    return UNSAFE_CHARS.sub("_", part)


class BadRef(ValueError):
    """A reference naming something it may not (another pipeline's segment, a path)."""


class CacheRef(msgspec.Struct, frozen=True):
    """What a shard needs to sync a version (the layout itself travels once)."""

    pipeline: str
    owner: str
    version: int  # the trainer step that produced these weights
    segment: str  # the shared-memory slot holding it
    generation: int  # the slot's seqlock value for this version
    fingerprint: str  # the layout (names, dtypes, shapes, buckets) it is packed with
    total_bytes: int
    host: str
    server: str = ""  # the owner's WeightServer endpoint, for shards on other nodes
    # Its CURVE public key (z85): a shard authenticates the server it pulls from with
    # this key, which reaches it through the coordinator from the pipeline's own driver.
    server_key: str = ""
    # How the owner serves receivers on other nodes (weights/transports/): "sealed" or
    # "plain" streams or "zmq" frames, the pipeline's weights.transport. On the owner's node a
    # receiver reads shared memory whatever this says.
    transport: str = "sealed"
    # Which start of the owner's cache wrote it: a restarted owner numbers its versions
    # from its checkpoint again, so a version number alone does not name the weights
    # (a node cache holding the old incarnation's version 6 must not serve it for the
    # new one's). Empty from an owner older than this field.
    incarnation: str = ""
    # The owner's Ed25519 public key (hex) for this incarnation: it signs each version's
    # manifest of bucket digests (weights/manifest.py), which a node checks what another
    # node relays against. Empty from an owner older than this field.
    manifest_key: str = ""

    def check_names(self) -> None:
        """Refuse (:class:`BadRef`, one line) a reference whose names could reach outside
        the pipeline's own files: the segment must be one of the pipeline's segment
        names (``rlix-<uid>-<pipeline>-<tag>-...``, one path component) and the layout
        fingerprint 16 hex digits (it too becomes a file name). The coordinator checks
        what a driver publishes, a shard what it is told to sync."""
        prefix = rf"rlix-[0-9]+-{re.escape(file_part(self.pipeline))}-{_TAG}-"
        if not re.fullmatch(prefix + r"[A-Za-z0-9_.\-]+", self.segment) or len(self.segment) > 255:
            raise BadRef(
                f"weights of {self.pipeline!r}: segment {self.segment[:80]!r} is not one of "
                "its shared-memory segment names"
            )
        if not _FINGERPRINT.fullmatch(self.fingerprint):
            raise BadRef(
                f"weights of {self.pipeline!r}: layout fingerprint {self.fingerprint[:40]!r} "
                "is not 16 hex digits"
            )


class Entry(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    bucket: int
    offset: int
    nbytes: int


class Layout(msgspec.Struct, frozen=True):
    entries: tuple[Entry, ...]
    bucket_sizes: tuple[int, ...]  # bytes used per bucket (multiple of ALIGN)
    bucket_bytes: int  # the configured bucket size

    @property
    def total_bytes(self) -> int:
        return sum(self.bucket_sizes)

    @property
    def bucket_offsets(self) -> list[int]:
        """Offset of each bucket when all buckets sit back to back in one segment."""
        out, pos = [], 0
        for size in self.bucket_sizes:
            out.append(pos)
            pos += size
        return out

    def fingerprint(self) -> str:
        """Identifies the model layout: same names, dtypes, shapes and bucketing."""
        return hashlib.sha256(msgspec.msgpack.encode(self)).hexdigest()[:16]

    def in_bucket(self, bucket: int) -> list[Entry]:
        return [e for e in self.entries if e.bucket == bucket]
