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
in sealed chunks. Nonces count up from zero under a key used for one stream
only, so a chunk dropped, reordered, replayed or altered fails authentication;
the receiver knows from the layout how many bytes must arrive, so a truncated
stream fails too. A ticket seen on the wire opens one stream whose bytes only
the key's holder can read; whoever uses it first can at most hold that stream
open, and every stream is cut at ``stream_timeout_s`` (below the cache's
``send_wait_s``), so the trainer's next build never waits longer on it. A
connection must show a ticket within ``hello_timeout_s``, and at most
``max_connections`` are open at once. The slot-generation check after the last
bucket runs on the CURVE socket, as for every remote sync.

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
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from rlix_async.aio import Supervisor
from rlix_async.protocol import Message, RpcError
from rlix_async.protocols.cache_ref import Layout
from rlix_async.protocols.sinks import SyncError
from rlix_async.weights.cache import WeightCache

log = logging.getLogger(__name__)

MAGIC = b"RLIXWS1\x00"  # what a receiver sends first, then its ticket
TICKET_BYTES = 32
TAG = 16  # AES-GCM tag
CHUNK = 1 << 20  # sealed chunk: small enough for short GIL holds, big enough for speed
_HEADER = struct.Struct("<QQQQ")  # version, index, nbytes, generation
STREAM_KINDS = ("sealed", "plain")  # what a grant may name
MAX_STREAMS = 16  # per transfer: more is refused (a receiver opens this many sockets)


class OpenStream(Message):
    """Ask the owner for a grant to stream ``version`` (on the CURVE socket)."""

    version: int
    transport: str = "sealed"  # or "plain" (only from an owner whose pipeline says so)


class StreamGrant(Message):
    transport: str
    port: int  # the owner's stream listener, on the WeightServer's host
    tickets: list[bytes]  # one per stream: stream j carries buckets j, j+S, j+2S...
    key: bytes  # b"" for plain
    chunk_bytes: int


def _nonce(counter: int, stream: int = 0) -> bytes:
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
    ) -> None:
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

    def grant(self, version: int, receiver: str, transport: str = "sealed") -> StreamGrant:
        """A fresh key (sealed) and a single-use ticket per stream for ``version`` (the
        caller checked who asks, and that ``transport`` may be sent)."""
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
        for stream, ticket in enumerate(tickets):
            self._pending[ticket] = _Pending(
                version, key, now + self.grant_ttl_s, receiver, transport, stream, streams, grant_id
            )
        return StreamGrant(
            transport=transport,
            port=self.port,
            tickets=tickets,
            key=key,
            chunk_bytes=self.chunk_bytes,
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
                aead.encrypt_into(_nonce(counter, pending.stream), plain, None, wire)
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
            send(_HEADER.pack(*self.bucket_header(pending.version, index, size, generation)))
            bucket = data[start : start + size]
            piece = chunk if aead is not None else max(size, 1)
            for off in range(0, max(size, 1), piece):
                send(bucket[off : off + piece])


async def _sock_read(loop: asyncio.AbstractEventLoop, conn: socket.socket, n: int) -> bytes:
    got = bytearray()
    while len(got) < n:
        part = await loop.sock_recv(conn, n - len(got))
        if not part:
            raise asyncio.IncompleteReadError(bytes(got), n)
        got += part
    return bytes(got)


def _recv_exact(conn: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = conn.recv_into(view[got:])
        if n == 0:
            raise SyncError("the owner closed the weight stream early")
        got += n


class StreamReceiver:
    """The shard's side of one stream: its buckets arrive in order, each opened and
    checked.

    A chunk is received straight into its place in the bucket buffer and decrypted
    there (AES-GCM in place), so the receiver holds nothing but its bucket buffers.
    """

    def __init__(self, host: str, grant: StreamGrant, stream: int, timeout: float) -> None:
        self.host, self.grant, self.timeout = host, grant, timeout
        self.stream = stream
        self.aead = AESGCM(grant.key) if grant.transport == "sealed" else None
        self.counter = 0
        self._conn: socket.socket | None = None
        self._lock = threading.Lock()  # connect (a thread) against close (the loop)
        self._closed = False

    def connect(self) -> None:
        conn = socket.create_connection((self.host, self.grant.port), timeout=self.timeout)
        with self._lock:
            if self._closed:  # closed while connecting: this socket is nobody's
                conn.close()
                raise SyncError("the weight stream was closed")
            self._conn = conn
        conn.settimeout(self.timeout)
        conn.sendall(MAGIC + self.grant.tickets[self.stream])

    def close(self) -> None:
        """Wake any read blocked on the socket (another thread's); from any thread.
        The descriptor itself goes at :meth:`release`, once no thread uses it."""
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def release(self) -> None:
        self.close()
        with self._lock:
            conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _open(self, buf: memoryview, nbytes: int) -> None:
        """Read one chunk of ``nbytes`` into ``buf`` (which has room for its tag) and,
        sealed, decrypt it in place into ``buf[:nbytes]``."""
        conn = self._conn
        if conn is None or self._closed:
            raise SyncError("the weight stream was closed")
        if self.aead is None:
            _recv_exact(conn, buf[:nbytes])
            return
        sealed = buf[: nbytes + TAG]
        _recv_exact(conn, sealed)
        try:
            self.aead.decrypt_into(_nonce(self.counter, self.stream), sealed, None, buf[:nbytes])
        except InvalidTag:
            raise SyncError(
                "a weight stream chunk failed authentication (altered, reordered or not "
                "from the owner)"
            ) from None
        self.counter += 1

    def read_bucket(self, expected: int, into: memoryview) -> tuple[int, int, int, int]:
        """One bucket into ``into[:expected]`` (``into`` has ``TAG`` bytes more); returns
        its header (version, index, nbytes, generation) for the caller to check."""
        header = bytearray(_HEADER.size + TAG)
        self._open(memoryview(header), _HEADER.size)
        version, index, nbytes, generation = _HEADER.unpack_from(header)
        if nbytes != expected:
            # never read a size we did not ask for into our buffer
            return version, index, nbytes, generation
        chunk = self.grant.chunk_bytes if self.aead is not None else max(expected, 1)
        for off in range(0, max(expected, 1), chunk):
            self._open(into[off:], min(chunk, expected - off))
        return version, index, nbytes, generation


def host_of(endpoint: str) -> str:
    """``tcp://HOST:PORT`` -> ``HOST`` (brackets of an IPv6 address removed)."""
    hostport = endpoint.removeprefix("tcp://")
    host = hostport.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


OnBucket = Callable[[int, tuple[int, int, int, int], memoryview], None]


def check_grant(grant: StreamGrant, asked: str) -> None:
    """Refuse a grant other than the one asked for: another transport (a plain grant
    to a receiver that asked for sealed is a downgrade), no ticket, too many streams
    (each is a socket and a thread here), or chunks of no size."""
    if grant.transport != asked or asked not in STREAM_KINDS:
        raise SyncError(f"asked for a {asked} stream, the owner granted {grant.transport!r}")
    if not 1 <= len(grant.tickets) <= MAX_STREAMS:
        raise SyncError(f"the owner granted {len(grant.tickets)} streams (1..{MAX_STREAMS})")
    if grant.chunk_bytes < 1 or (asked == "sealed" and len(grant.key) != 32):
        raise SyncError("the owner granted a stream with no chunk size or a bad key")


async def receive_stream(
    endpoint: str,
    grant: StreamGrant,
    layout: Layout,
    buffers: int,
    timeout: float,
    on_bucket: OnBucket,
    *,
    transport: str = "sealed",
) -> None:
    """Read every bucket of a granted transfer (of the ``transport`` asked for), on as
    many streams as the grant has tickets; ``on_bucket(index, header, data)`` runs on
    the event loop's thread (where the sink lives) while the streams read on, in the
    order buckets land (stream by stream in order; across streams as they come).

    ``buffers`` bucket-sized buffers (at least one per stream) are reused round-robin
    within each stream: with two or more per stream, reading a stream's next bucket
    overlaps loading its last; the receiver's extra memory stays within
    ``max(buffers, streams) x bucket``. One stream failing ends them all, and no
    thread reads into a buffer or a socket after this returns.
    """
    check_grant(grant, transport)
    streams = len(grant.tickets)
    host = host_of(endpoint)
    receivers = [StreamReceiver(host, grant, j, timeout) for j in range(streams)]
    per_stream = max(1, buffers // streams)
    n = len(layout.bucket_sizes)
    tasks = [
        asyncio.ensure_future(
            _receive_one(r, layout.bucket_sizes, list(range(j, n, streams)), per_stream, on_bucket)
        )
        for j, r in enumerate(receivers)
    ]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        failed = next((t for t in tasks if t.done() and not t.cancelled() and t.exception()), None)
        if failed is not None:
            raise failed.exception()  # type: ignore[misc]
    finally:
        for r in receivers:
            r.close()  # wakes the reads of the streams still running: they end at once
        # wait for them rather than cancel them: a cancelled task leaves its thread
        # reading into our buffers (a connect ends within its own timeout)
        _, stuck = await asyncio.wait(tasks, timeout=timeout + 5.0)
        for t in stuck:
            t.cancel()
        for t in tasks:
            if t.done() and not t.cancelled():
                t.exception()  # retrieved: the first failure was raised above
        for r in receivers:
            r.release()


async def _receive_one(
    receiver: StreamReceiver,
    sizes: Sequence[int],
    indices: list[int],
    buffers: int,
    on_bucket: OnBucket,
) -> None:
    """One stream's buckets (``indices``, in the order it sends them)."""
    if not indices:
        return
    biggest = max(sizes[i] for i in indices)
    pool = [bytearray(biggest + TAG) for _ in range(max(1, min(buffers, len(indices))))]

    def read(k: int) -> asyncio.Future[tuple[int, int, int, int]]:
        view = memoryview(pool[k % len(pool)])
        return asyncio.ensure_future(
            asyncio.to_thread(receiver.read_bucket, sizes[indices[k]], view)
        )

    pending: asyncio.Future[tuple[int, int, int, int]] | None = None
    try:
        await asyncio.to_thread(receiver.connect)
        pending = read(0)
        for k, index in enumerate(indices):
            assert pending is not None  # one read is always in flight here
            header = await pending
            pending = None
            more = k + 1 < len(indices)
            if more and len(pool) > 1 and header[2] == sizes[index]:
                pending = read(k + 1)  # overlaps the load below: another buffer
            on_bucket(index, header, memoryview(pool[k % len(pool)])[: sizes[index]])
            if pending is None and more:
                pending = read(k + 1)
    finally:
        if pending is not None and not pending.done():
            receiver.close()  # ends the read in flight
            await asyncio.wait([pending])  # its thread has let go of the buffer
