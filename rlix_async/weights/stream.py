"""Bulk weight bytes between nodes: AES-256-GCM over plain tcp, keyed over CURVE
(``sealed``), or the bare bytes (``plain``, for a fabric the operator trusts), on one
or several tcp streams per transfer.

Why not CURVE for the bytes: libsodium seals every ZMQ frame through a
per-message box at about 0.3-0.4 GiB/s here (35 s per node to move a 14 GB
model). TLS through Python's ``ssl`` reaches about 1.2 GiB/s, held back by one
Python call per 16 KiB record on the receiver. Sealing 1 MiB chunks with
AES-256-GCM (``cryptography``, AES-NI, GIL released) over a plain socket runs
at about 2 GiB/s bare, and 1.15-1.2 GiB/s through the cache and the sink here
(3.3-3.4x CURVE, 0.8x unencrypted ZMQ: docs/PERF.md).

The owner's CURVE :class:`~rlix_async.weights.tcp.WeightServer` stays the
only door: a receiver that it authenticated and admitted asks it for a *grant*
(``OpenStream``), which carries, encrypted by CURVE, a fresh random 256-bit key
and a single-use ticket for a plain tcp listener next to the server. The
receiver connects, presents the ticket, and reads the version's buckets: per
bucket a sealed header (version, index, size, slot generation), then its bytes
in sealed chunks (the receiver's side: ``weights/stream_receiver.py``). Nonces count
up from zero under a key used for one transfer only, so a chunk dropped, reordered, replayed or altered fails authentication;
the receiver knows from the layout how many bytes must arrive, so a truncated
stream fails too. A ticket seen on the wire opens one stream whose bytes only
the key's holder can read; whoever uses it first can at most hold that stream
open, and every stream is cut at ``stream_timeout_s`` (below the cache's
``send_wait_s``), so the trainer's next build never waits longer on it. A
connection must show a ticket within ``hello_timeout_s``, and at most
``max_connections`` are open at once. The slot-generation check after the last
bucket runs on the CURVE socket, as for every remote sync.

Deltas: a receiver that holds the version before it whole says so
(``OpenStream.base``); where the owner has the version encoded against that one
(``weights/delta_source.py``) the grant says ``delta_base``, and each bucket's
header also names its encoding (full, sparse, or XOR and zstd: ``weights/delta.py``),
its size that of the encoded bytes (never more than the bucket's). The receiver
checks each decoded bucket against the owner's signed manifest before it counts.

Several streams: one core seals (or opens) about 2 GiB/s, less than a fast link
carries, so a grant may hold S tickets (the owner's ``weights.streams``); stream j
carries buckets j, j+S, j+2S... under the one key, its nonces prefixed with j, so a
chunk moved from one stream to another fails authentication like a reordered one.
Each stream has its own thread on each side: sealing spreads over S cores.

``plain``: the same tickets and headers, the bytes unsealed. Anyone on the path can
read the weights and alter them undetected (tcp's checksum is no defence); an owner
grants it only when its pipeline says ``weights.transport: plain``, and a receiver
that asked for ``sealed`` refuses a plain grant (no downgrade by a confused owner).

A GPU transport plugs in the same way: the grant carries a rendezvous (address, port,
ranks) instead of a key, the owner broadcasts the buckets from its device copy in a
temporary process group torn down after the sync, and the same generation check
closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from rlix_async.aio import Supervisor
from rlix_async.protocol import Message, RpcError
from rlix_async.weights.cache import WeightCache
from rlix_async.weights.delta import Kind

log = logging.getLogger(__name__)

MAGIC = b"RLIXWS1\x00"  # what a receiver sends first, then its ticket
TICKET_BYTES = 32
TAG = 16  # AES-GCM tag
CHUNK = 1 << 20  # sealed chunk: small enough for short GIL holds, big enough for speed
BUCKET_HEADER = struct.Struct("<QQQQ")  # version, index, nbytes, generation
DELTA_HEADER = struct.Struct("<QQQQQ")  # version, index, nbytes, generation, delta.Kind
STREAM_KINDS = ("sealed", "plain")  # what a grant may name
MAX_STREAMS = 16  # per transfer: more is refused (a receiver opens this many sockets)


class OpenStream(Message):
    """Ask the owner for a grant to stream ``version`` (on the CURVE socket)."""

    version: int
    transport: str = "sealed"  # or "plain" (only from an owner whose pipeline says so)
    base: int = -1  # the version the receiver holds whole (of this owner's start): deltas
    after_failed_delta: bool = False  # asked whole again: a delta did not apply (counted)


class StreamGrant(Message):
    transport: str
    port: int  # the owner's stream listener, on the WeightServer's host
    tickets: list[bytes]  # one per stream: stream j carries buckets j, j+S, j+2S...
    key: bytes  # b"" for plain
    chunk_bytes: int
    delta_base: int = -1  # >= 0: buckets come encoded against this version (DELTA_HEADER)


class DeltaProvider(Protocol):
    """Where a streamer takes a version's buckets encoded against a base: the owner's
    ``VersionDeltas`` (``weights/delta_source.py``), a relay's ``RelayedDeltas``."""

    def offers(self, version: int, base: int) -> bool: ...
    def bucket(
        self, version: int, base: int, index: int, timeout: float
    ) -> tuple[int, bytes | memoryview] | None:
        """Bucket ``index``'s encoding and payload (None: send it whole)."""
        ...


def chunk_nonce(counter: int, stream: int = 0) -> bytes:
    return stream.to_bytes(4, "little") + counter.to_bytes(8, "little")


@dataclass
class _Pending:
    version: int
    key: bytes
    expires: float
    receiver: str
    transport: str
    stream: int  # this ticket's stream, of
    streams: int
    grant: str  # which grant it belongs to (a receiver's unused grants are counted)
    delta_base: int = -1


class StreamDone:
    """A :class:`~rlix_async.weights.cache.SendTracker` for one stream: the cache
    waits for it before it rewrites the slot being read."""

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def wait(self, timeout: float) -> None:
        self._event.wait(timeout)


@dataclass
class StreamSource:
    """What a stream of one version reads: the version's bytes (its slot's data area),
    the slot's generation, how a send is tracked against the slot's rewrite, and (a
    relay's version still arriving) a wait for bucket ``i`` to land, called from the
    sending thread with the time left (raises if it never lands whole)."""

    data: memoryview
    generation: int
    track: Callable[[StreamDone], None]
    wait_bucket: Callable[[int, float], None] | None = None


class WeightStreamer:
    """The owner's side: grants tickets and streams buckets (sealed or plain) to
    whoever holds one, ``streams`` connections per transfer. ``source``: where a
    version's bytes are read (default: the cache's offered slots; a relay's version
    still arriving: ``weights/relay.py``); None: the version is not here."""

    def __init__(
        self,
        cache: WeightCache,
        host: str,
        *,
        grant_ttl_s: float = 30.0,
        hello_timeout_s: float = 5.0,
        stream_timeout_s: float | None = None,
        max_connections: int = 64,
        grants_per_receiver: int = 4,
        chunk_bytes: int = CHUNK,
        streams: int = 1,
        source: Callable[[int], Awaitable[StreamSource | None]] | None = None,
        deltas: DeltaProvider | None = None,
    ) -> None:
        """``deltas``: where versions encoded against their predecessor are (None: every
        bucket goes whole)."""
        if not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be in 1..{MAX_STREAMS}, not {streams}")
        self.streams = streams
        self.source = source or self.cached
        # a transfer takes ``streams`` connections: the cap counts receivers' worth
        max_connections *= streams
        self.cache = cache
        self.host = host
        self.grant_ttl_s = grant_ttl_s
        self.hello_timeout_s = hello_timeout_s
        # A stream slower than this is cut (that shard's sync fails and is retried):
        # it holds the slot it reads, and the trainer's next build must not wait on it
        # longer than the cache lets it.
        self.stream_timeout_s = stream_timeout_s or max(1.0, cache.send_wait_s - 5.0)
        self.grants_per_receiver = grants_per_receiver
        self.chunk_bytes = chunk_bytes
        self._connections = asyncio.Semaphore(max_connections)
        # the sending threads, one per admitted connection: never queued behind other
        # work (a stream waiting for a thread would hold its slot uncounted)
        self._threads = ThreadPoolExecutor(max_connections, thread_name_prefix="weight-stream")
        self._pending: dict[bytes, _Pending] = {}
        self.refused = 0
        self._listener: socket.socket | None = None
        self._tasks = Supervisor("sealed-streamer")
        self.streams_sent = 0
        self._sent = asyncio.Condition()
        self.deltas = deltas
        # what the streams sent, and what those buckets whole would have been (step rows)
        self.wire_bytes = 0
        self.full_bytes = 0
        self.delta_fallbacks = 0  # receivers that asked whole after a delta failed them
        self.whole_grants = 0  # with deltas on: streams granted whole (no base, or another)
        self._counting = threading.Lock()

    async def wait_sent(self, count: int, timeout: float) -> bool:
        """Whether ``count`` streams have been sent within ``timeout`` seconds: a
        receiver can hold every byte before the sending thread has returned."""
        async with self._sent:
            try:
                await asyncio.wait_for(
                    self._sent.wait_for(lambda: self.streams_sent >= count), timeout
                )
            except TimeoutError:
                return False
        return True

    @property
    def port(self) -> int:
        assert self._listener is not None, "start() first"
        return int(self._listener.getsockname()[1])

    async def start(self) -> WeightStreamer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("" if self.host in ("*", "0.0.0.0") else self.host, 0))
        listener.listen(64)
        listener.setblocking(False)
        self._listener = listener
        self._tasks.spawn(self._accept_loop(), "accept")
        return self

    async def close(self) -> None:
        await self._tasks.close()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self._threads.shutdown(wait=False)

    def grant(
        self,
        version: int,
        receiver: str,
        transport: str = "sealed",
        base: int = -1,
        after_failed_delta: bool = False,
    ) -> StreamGrant:
        """A fresh key (sealed) and a single-use ticket per stream for ``version`` (the
        caller checked who asks, and that ``transport`` may be sent); as deltas on
        ``base`` where this owner has them."""
        if transport not in STREAM_KINDS:
            raise ValueError(f"transport must be one of {STREAM_KINDS}, not {transport!r}")
        now = time.monotonic()
        self._pending = {t: p for t, p in self._pending.items() if p.expires > now}
        unused = {p.grant for p in self._pending.values() if p.receiver == receiver}
        if len(unused) >= self.grants_per_receiver:
            raise RpcError(
                "too_many_streams", f"{receiver} holds {self.grants_per_receiver} unused grants"
            )
        layout = self.cache.layout
        # never more streams than buckets: each stream carries at least one
        streams = max(1, min(self.streams, len(layout.bucket_sizes) if layout else 1))
        key = AESGCM.generate_key(256) if transport == "sealed" else b""
        tickets = [secrets.token_bytes(TICKET_BYTES) for _ in range(streams)]
        grant_id = secrets.token_hex(8)
        if after_failed_delta:
            self.delta_fallbacks += 1
        offered = base >= 0 and self.deltas is not None and self.deltas.offers(version, base)
        delta_base = base if offered else -1
        if self.deltas is not None and not offered:
            self.whole_grants += 1
        for stream, ticket in enumerate(tickets):
            self._pending[ticket] = _Pending(
                version,
                key,
                now + self.grant_ttl_s,
                receiver,
                transport,
                stream,
                streams,
                grant_id,
                delta_base,
            )
        return StreamGrant(
            transport=transport,
            port=self.port,
            tickets=tickets,
            key=key,
            chunk_bytes=self.chunk_bytes,
            delta_base=delta_base,
        )

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: back off, keep serving
                log.warning("weight stream listener: accept failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            if self._connections.locked():  # at the cap: nobody gets to hold a socket open
                conn.close()
                self._refuse("at the connection cap")
                continue
            self._tasks.spawn(self._serve(conn), "stream")

    def _refuse(self, why: str) -> None:
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th...: no log flood
            log.warning("weight stream: refused a connection (%s; %d so far)", why, self.refused)

    async def _serve(self, conn: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            async with self._connections:
                await self._serve_one(loop, conn)
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            log.warning("weight stream ended early: %s", exc)
        finally:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a sending thread blocked on it
            conn.close()

    async def _serve_one(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        try:
            hello = await asyncio.wait_for(
                _sock_read(loop, conn, len(MAGIC) + TICKET_BYTES), self.hello_timeout_s
            )
        except (TimeoutError, asyncio.IncompleteReadError):
            self._refuse("no hello")
            return
        pending = self._pending.pop(hello[len(MAGIC) :], None)
        if hello[: len(MAGIC)] != MAGIC or pending is None or pending.expires < time.monotonic():
            self._refuse("no valid ticket")
            return
        source = await self.source(pending.version)
        if source is None:
            return  # rebuilt since the grant: the receiver sees the stream end early
        conn.setblocking(True)
        tracker = StreamDone()  # set by the sending thread, whatever happens
        source.track(tracker)
        started = time.perf_counter()
        await loop.run_in_executor(self._threads, self._send_all, conn, pending, source, tracker)
        self.streams_sent += 1
        async with self._sent:
            self._sent.notify_all()
        seconds = time.perf_counter() - started
        log.info(
            "weights: %s stream %d/%d of version %d to %s in %.2f s (the version: %.1f MiB)",
            pending.transport, pending.stream + 1, pending.streams, pending.version,
            pending.receiver, seconds, len(source.data) / (1 << 20),
        )  # fmt: skip

    async def cached(self, version: int) -> StreamSource | None:
        """A version offered in the cache, taken here on the loop with its slot offered."""
        if version not in self.cache.versions:
            return None
        return StreamSource(
            self.cache.buffer(version),
            self.cache.ref(version).generation,
            lambda tracker: self.cache.track(version, tracker),
        )

    def bucket_header(
        self, version: int, index: int, nbytes: int, generation: int
    ) -> tuple[int, int, int, int]:
        """What the receiver checks before a bucket's bytes may land."""
        return version, index, nbytes, generation

    def _send_all(
        self,
        conn: socket.socket,
        pending: _Pending,
        source: StreamSource,
        tracker: StreamDone,
    ) -> None:
        """Runs in a worker thread: send this stream's buckets of the version, then
        release the slot (here, not on the event loop, which may be busy)."""
        try:
            self._send_buckets(conn, pending, source)
        finally:
            tracker.set()

    def _send_buckets(self, conn: socket.socket, pending: _Pending, source: StreamSource) -> None:
        """Per bucket of this stream (j, j+S, ...): its header, then its bytes, in
        ``chunk_bytes`` pieces each sealed under the stream's next nonce (sealed), or
        straight from the slot in one send (plain)."""
        layout, chunk = self.cache.layout, self.chunk_bytes
        assert layout is not None
        aead = AESGCM(pending.key) if pending.transport == "sealed" else None
        out = bytearray(chunk + TAG)
        counter = 0
        deadline = time.monotonic() + self.stream_timeout_s

        def send(plain: memoryview | bytes) -> None:
            nonlocal counter
            wire = plain
            if aead is not None:
                wire = memoryview(out)[: len(plain) + TAG]
                aead.encrypt_into(chunk_nonce(counter, pending.stream), plain, None, wire)
                counter += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"stream to {pending.receiver} ran past {self.stream_timeout_s}s"
                )
            conn.settimeout(left)  # sendall's timeout bounds the whole call
            conn.sendall(wire)

        data, generation = source.data, source.generation
        for index in range(pending.stream, len(layout.bucket_sizes), pending.streams):
            if source.wait_bucket is not None:  # a relay's: it may still be arriving
                source.wait_bucket(index, max(0.0, deadline - time.monotonic()))
            start, size = layout.bucket_offsets[index], layout.bucket_sizes[index]
            header = self.bucket_header(pending.version, index, size, generation)
            payload: memoryview | bytes = data[start : start + size]
            if pending.delta_base < 0 or self.deltas is None:
                send(BUCKET_HEADER.pack(*header))
            else:  # this bucket encoded, or whole where its encoding is not to be had
                left = max(0.0, deadline - time.monotonic())
                encoded = self.deltas.bucket(pending.version, pending.delta_base, index, left)
                kind, payload = (Kind.FULL, payload) if encoded is None else encoded
                send(DELTA_HEADER.pack(header[0], header[1], len(payload), header[3], kind))
            n = len(payload)
            piece = chunk if aead is not None else max(n, 1)
            for off in range(0, max(n, 1), piece):
                send(payload[off : off + piece])
            with self._counting:
                self.wire_bytes += n
                self.full_bytes += size


async def _sock_read(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        part = await loop.sock_recv(conn, n - len(got))
        if not part:
            raise asyncio.IncompleteReadError(bytes(got), n)
        got += part
    return bytes(got)


def host_of(endpoint: str) -> str:
    """``tcp://HOST:PORT`` -> ``HOST`` (brackets of an IPv6 address removed)."""
    hostport = endpoint.removeprefix("tcp://")
    host = hostport.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host
