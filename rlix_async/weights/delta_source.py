"""The owner's deltas: each new version encoded against the version before it, once,
for every receiver that holds that one (``weights/delta.py`` says how a bucket is
encoded; ``weights/stream.py`` sends what is here).

After ``build(v)`` the cache's other slot holds ``v-1`` (the promoted version) until
``build(v+1)``. :meth:`VersionDeltas.encode` starts a thread that encodes ``v``
against it bucket by bucket, off the training path: the trainer goes on with its
next step meanwhile, and a stream that asks for bucket ``i`` before it is encoded
waits for that bucket only (sending overlaps encoding). Both slots are held for the
thread (the cache's send trackers), so nothing rewrites what it reads; the owner
calls :meth:`VersionDeltas.stop` before its next ``build``, which ends an encoding
still running at its next bucket (the buckets it did not reach go whole): a step
faster than the encoding never waits more than one bucket's encoding for it. Only the
newest version's deltas are kept; a FULL bucket's payload is a view of the slot, so
the memory held is the encoded buckets alone.

``auto`` switches itself off where deltas do not pay: a version whose encoding came
to more than ``OFF_ABOVE`` of its full size, or took more than ``MAX_COST_SHARE`` of
the time between two builds (a step: the encoding's cores are the trainer's and the
rollout's), is followed by ``PROBE_EVERY - 1`` versions not encoded at all, then one
encoded again to see whether that changed. A float32 cache, where 95% of the
elements move each step, still encodes to about half its size (XOR leaves the sign,
exponent and high mantissa bits at zero), at a cost the second rule weighs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

from rlix_async.weights.cache import WeightCache
from rlix_async.weights.delta import DeltaStats, Encoded, Kind, encode, stats_of, word_bytes
from rlix_async.weights.stream import StreamDone, WeightStreamer

log = logging.getLogger(__name__)

OFF_ABOVE = 0.9  # wire over full: a delta this large is not worth its encoding
MAX_COST_SHARE = 0.1  # of the time between builds: what the encoding may take
PROBE_EVERY = 10  # versions: how often a switched-off auto encodes one to look again


@dataclass
class _Encoding:
    version: int
    base: int
    buckets: list[Encoded | None]
    interval: float | None  # since the build before (a step), where known
    started: float = field(default_factory=time.perf_counter)
    failed: bool = False  # an error, not a stop: offered to no new stream
    done: threading.Condition = field(default_factory=threading.Condition)
    stopping: bool = False  # set by stop(): end at the next bucket
    ended: bool = False  # the thread is done: a bucket not encoded by now never will be
    thread: threading.Thread | None = None


class VersionDeltas:
    """The newest version's buckets encoded against the previous version, for the
    owner's streams (``bucket``) and its step rows (``take_stats``)."""

    def __init__(
        self,
        cache: WeightCache,
        mode: Literal["auto", "off"] = "auto",
        max_cost_share: float | None = MAX_COST_SHARE,
    ) -> None:
        """``max_cost_share``: auto's second rule (None: only the size decides)."""
        self.cache = cache
        self.mode = mode
        self.max_cost_share = max_cost_share
        self._encoding: _Encoding | None = None
        self._lock = threading.Lock()
        self._stats: DeltaStats | None = None  # the newest finished, not yet taken
        self._skip = 0  # versions left unencoded (auto, switched off)
        self.stopped = 0  # encodings the next build stopped before they were whole
        self._last_build: float | None = None  # when encode() was last called

    def encode(self, version: int) -> bool:
        """Start encoding ``version`` (just built) against the version in the cache's
        other slot; False where there is none, or deltas are off. Call it before the
        cache's next build."""
        cache = self.cache
        now = time.perf_counter()
        interval = None if self._last_build is None else now - self._last_build
        self._last_build = now
        bases = [v for v in cache.versions if v != version]
        with self._lock:
            self._encoding = None  # the older version's deltas are of no use from now on
            if self.mode == "off" or not bases or cache.layout is None:
                return False
            if self._skip:
                self._skip -= 1
                return False
        base = max(bases)
        enc = _Encoding(version, base, [None] * len(cache.layout.bucket_sizes), interval)
        holds = [StreamDone(), StreamDone()]  # the next build waits for these
        cache.track(version, holds[0])
        cache.track(base, holds[1])
        with self._lock:
            self._encoding = enc
        enc.thread = threading.Thread(
            target=self._run, args=(enc, holds), name=f"delta-{version}", daemon=True
        )
        try:
            enc.thread.start()
        except BaseException:  # (no thread to be had): the slots are not held, no deltas
            for hold in holds:
                hold.set()
            with self._lock:
                self._encoding = None
            raise
        return True

    def join(self, timeout: float) -> bool:
        """Wait (``timeout`` at most) for the encoding under way to end; whether it did."""
        enc = self._encoding
        if enc is not None and enc.thread is not None:
            enc.thread.join(timeout)
            return not enc.thread.is_alive()
        return True

    def stop(self, timeout: float = 60.0) -> None:
        """End the encoding under way at its next bucket and wait (``timeout`` at most)
        for its thread to let go of the slots: before the cache's next build."""
        if self._encoding is not None:
            self._encoding.stopping = True
        self.join(timeout)

    def _run(self, enc: _Encoding, holds: list[StreamDone]) -> None:
        cache = self.cache
        try:
            layout = cache.layout
            assert layout is not None
            new, old = cache.buffer(enc.version), cache.buffer(enc.base)
            for i, (start, size) in enumerate(
                zip(layout.bucket_offsets, layout.bucket_sizes, strict=True)
            ):
                if enc.stopping:  # what it encoded still goes as deltas
                    log.info("weight deltas: version %d not encoded whole", enc.version)
                    with self._lock:
                        self.stopped += 1
                    return
                end = start + size
                encoded = encode(old[start:end], new[start:end], word_bytes(layout, i))
                with enc.done:
                    enc.buckets[i] = encoded
                    enc.done.notify_all()
            stats = stats_of(
                enc.version,
                enc.base,
                [b for b in enc.buckets if b is not None],
                layout.total_bytes,
                time.perf_counter() - enc.started,
            )
            share = self.max_cost_share
            costly = (
                share is not None
                and enc.interval is not None
                and stats.encode_s > share * enc.interval
            )
            off = self.mode == "auto" and (stats.wire_per_full > OFF_ABOVE or costly)
            with self._lock:
                if self._encoding is not enc:  # a stop() that timed out: a newer one runs
                    return
                self._stats = stats
                if off:
                    self._skip = PROBE_EVERY - 1
            if off:
                log.info(
                    "weight deltas: version %d came to %.2fx its full size (%.0f%% of its "
                    "elements moved) in %.1f s (%s s between builds); not encoding the "
                    "next %d versions",
                    enc.version, stats.wire_per_full, 100 * stats.changed_fraction,
                    stats.encode_s, f"{enc.interval:.1f}" if enc.interval else "?",
                    PROBE_EVERY - 1,
                )  # fmt: skip
        except Exception as exc:  # a stream asking for it sends the full buckets instead
            log.error("weight deltas: encoding version %d failed: %s", enc.version, exc)
            enc.failed = True
        finally:
            with enc.done:
                enc.ended = True
                enc.done.notify_all()
            for hold in holds:
                hold.set()

    def offers(self, version: int, base: int) -> bool:
        """Whether ``version`` can go as deltas on ``base`` (being encoded, or done)."""
        enc = self._encoding
        return enc is not None and (enc.version, enc.base) == (version, base) and not enc.failed

    def bucket(
        self, version: int, base: int, index: int, timeout: float
    ) -> tuple[int, bytes | memoryview] | None:
        """Bucket ``index`` of ``version`` encoded against ``base``, waiting for it at
        most ``timeout`` s (from a sending thread); None if it is not to be had (the
        encoding failed, moved on to a newer version, or took too long): the stream
        then sends that bucket whole."""
        enc = self._encoding
        if enc is None or (enc.version, enc.base) != (version, base):
            return None
        with enc.done:
            enc.done.wait_for(lambda: enc.buckets[index] is not None or enc.ended, timeout)
            encoded = enc.buckets[index]
        return None if encoded is None else (encoded.kind, encoded.payload)

    def take_stats(self) -> DeltaStats | None:
        """The newest finished encoding's figures, once (None: none since)."""
        with self._lock:
            stats, self._stats = self._stats, None
        return stats


def stats_row(deltas: VersionDeltas) -> dict[str, float | int]:
    """A step row's ``delta_*`` fields: the encodings the steps outran so far, and the
    newest whole version's figures (none: nothing encoded whole since the last row)."""
    row: dict[str, float | int] = {"delta_stopped": deltas.stopped}
    stats = deltas.take_stats()
    if stats is None:
        return row
    return {
        **row,
        "delta_version": stats.version,
        "delta_changed_fraction": round(stats.changed_fraction, 6),
        "delta_wire_per_full": round(stats.wire_per_full, 6),
        "delta_sparse_per_full": round(stats.sparse_bytes / stats.full_bytes, 6),
        "delta_xor_zstd_per_full": round(stats.xor_zstd_bytes / stats.full_bytes, 6),
        "delta_encode_s": round(stats.encode_s, 4),
        "delta_buckets_sparse": stats.kinds[Kind.SPARSE],
        "delta_buckets_xor_zstd": stats.kinds[Kind.XOR_ZSTD],
        "delta_buckets_full": stats.kinds[Kind.FULL],
    }


class WireRows:
    """A trainer's step-row fields for what its weight server sent other nodes."""

    def __init__(self, streamer: WeightStreamer | None, deltas: VersionDeltas | None) -> None:
        self.streamer, self.deltas = streamer, deltas
        self._sent = (0, 0)  # the streamer's (wire, whole) bytes at the last row

    def row(self) -> dict[str, float | int]:
        """Since the last row ``sync_bytes_wire`` (as sent) and ``sync_bytes_full``
        (those buckets whole); so far ``delta_fallbacks`` (receivers that asked whole
        after a delta failed them) and ``delta_whole_grants`` (versions sent whole with
        deltas on: the receiver held no base, or another); the newest encoding's
        ``delta_*``."""
        if self.streamer is None:  # (an ipc endpoint: no streams)
            return {}
        wire, full = self.streamer.wire_bytes, self.streamer.full_bytes
        row: dict[str, float | int] = {
            "sync_bytes_wire": wire - self._sent[0],
            "sync_bytes_full": full - self._sent[1],
            "delta_fallbacks": self.streamer.delta_fallbacks,
            "delta_whole_grants": self.streamer.whole_grants,
        }
        self._sent = (wire, full)
        if self.deltas is not None:
            row.update(stats_row(self.deltas))
        return row
