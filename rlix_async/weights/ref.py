"""What names a cached weight version on the wire: torch-free, so the coordinator and the
control messages can carry it without importing torch."""

from __future__ import annotations

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
