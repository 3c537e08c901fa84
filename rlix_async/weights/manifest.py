"""What lets a node take a version from another node and know it is the owner's.

A relaying node (``weights/node_cache.py``) forwards buckets it did not write and
could alter. So the owner signs, per version, a manifest of every bucket's SHA-256
with an Ed25519 key of its own (made at each start of its cache, never written to a
file); its public key reaches receivers in the ``CacheRef`` (``manifest_key``), which
comes to them through the coordinator from the pipeline's own driver, never through a
relay. A receiver checks the manifest's signature against that key and each bucket's
digest as it lands, before it offers the version; a bucket that does not match fails
the pull, and the node takes the version from the owner instead.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SyncError
from rlix_async.weights.packing import buckets_of


class Manifest(msgspec.Struct, frozen=True):
    pipeline: str
    owner: str
    incarnation: str
    version: int
    fingerprint: str
    digests: list[bytes]  # SHA-256 of each bucket, in order
    signature: bytes = b""

    def payload(self) -> bytes:
        return msgspec.msgpack.encode(msgspec.structs.replace(self, signature=b""))


def bucket_digest(data: memoryview | bytes) -> bytes:
    return hashlib.sha256(data).digest()


def digests_of(layout: Layout, buf: memoryview) -> list[bytes]:
    """Every bucket's digest, on all cores (hashlib releases the GIL on large inputs)."""
    buckets = buckets_of(layout, buf)
    with ThreadPoolExecutor(max_workers=min(len(buckets), os.cpu_count() or 1) or 1) as pool:
        return list(pool.map(lambda b: bucket_digest(b.data), buckets))


class ManifestSigner:
    """The owner's signing key for one start of its cache."""

    def __init__(self) -> None:
        self._key = Ed25519PrivateKey.generate()
        self.public_hex = self._key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw).hex()

    def sign(self, ref: CacheRef, layout: Layout, buf: memoryview) -> Manifest:
        unsigned = Manifest(
            ref.pipeline,
            ref.owner,
            ref.incarnation,
            ref.version,
            ref.fingerprint,
            digests_of(layout, buf),
        )
        return msgspec.structs.replace(unsigned, signature=self._key.sign(unsigned.payload()))


def verify(manifest: Manifest, ref: CacheRef) -> None:
    """Raise a one-line SyncError unless ``manifest`` is the owner's, for ``ref``'s
    version and layout (``ref``: what the coordinator said, with the owner's key). The
    digests' count is checked against the layout where the buckets land."""
    expected = (ref.pipeline, ref.owner, ref.incarnation, ref.version, ref.fingerprint)
    got = (
        manifest.pipeline,
        manifest.owner,
        manifest.incarnation,
        manifest.version,
        manifest.fingerprint,
    )
    if got != expected:
        raise SyncError(f"version {ref.version}: a manifest of another version ({got[3]})")
    if not ref.manifest_key:
        raise SyncError(f"version {ref.version}: the owner published no manifest key")
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(ref.manifest_key))
        key.verify(manifest.signature, manifest.payload())
    except (InvalidSignature, ValueError):
        raise SyncError(f"version {ref.version}: its manifest is not signed by the owner") from None
