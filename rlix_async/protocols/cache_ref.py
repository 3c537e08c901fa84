"""What names a cached weight version on the wire, and the layout it is packed with:
torch-free, so the coordinator and the control messages carry them without torch."""

from __future__ import annotations

import hashlib

import msgspec


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
