"""Bulk weight bytes between nodes: AES-256-GCM over plain tcp, keyed over CURVE.

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

The grant names its ``transport``; ``"sealed"`` (this module) is the only one
served today. A GPU transport plugs in the same way: the grant carries a
rendezvous (address, port, ranks) instead of a key, the owner broadcasts the
buckets from its device copy in a temporary process group torn down after the
sync, and the same generation check closes it.
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
from collections.abc import Callable
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


class OpenStream(Message):
    """Ask the owner for a grant to stream ``version`` (on the CURVE socket)."""

    version: int
    transport: str = "sealed"


class StreamGrant(Message):
    transport: str
    port: int  # the owner's stream listener, on the WeightServer's host
    ticket: bytes
    key: bytes
    chunk_bytes: int


def _nonce(counter: int) -> bytes:
    return b"\x00\x00\x00\x00" + counter.to_bytes(8, "little")


@dataclass
class _Pending:
    version: int
    key: bytes
    expires: float
    receiver: str


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


class SealedStreamer:
    """The owner's side: grants tickets and streams sealed buckets to whoever holds one."""

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
    ) -> None:
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

    async def start(self) -> SealedStreamer:
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

    def grant(self, version: int, receiver: str) -> StreamGrant:
        """A fresh key and single-use ticket for ``version`` (the caller checked who asks)."""
        now = time.monotonic()
        self._pending = {t: p for t, p in self._pending.items() if p.expires > now}
        if sum(p.receiver == receiver for p in self._pending.values()) >= self.grants_per_receiver:
            raise RpcError(
                "too_many_streams", f"{receiver} holds {self.grants_per_receiver} unused grants"
            )
        ticket, key = secrets.token_bytes(TICKET_BYTES), AESGCM.generate_key(256)
        self._pending[ticket] = _Pending(version, key, now + self.grant_ttl_s, receiver)
        return StreamGrant(
            transport="sealed", port=self.port, ticket=ticket, key=key, chunk_bytes=self.chunk_bytes
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
        if pending.version not in self.cache.versions:
            return  # rebuilt since the grant: the receiver sees the stream end early
        # What the thread reads, taken here on the loop with the slot still offered.
        data, generation = (
            self.cache.buffer(pending.version),
            self.cache.ref(pending.version).generation,
        )
        conn.setblocking(True)
        tracker = StreamDone()  # set by the sending thread, whatever happens
        self.cache.track(pending.version, tracker)
        started = time.perf_counter()
        await asyncio.to_thread(self._send_all, conn, pending, data, generation, tracker)
        self.streams_sent += 1
        async with self._sent:
            self._sent.notify_all()
        seconds = time.perf_counter() - started
        log.info(
            "weights: sealed stream of version %d to %s, %.1f MiB in %.2f s (%.2f GiB/s)",
            pending.version, pending.receiver, len(data) / (1 << 20), seconds,
            len(data) / max(seconds, 1e-9) / (1 << 30),
        )  # fmt: skip

    def bucket_header(
        self, version: int, index: int, nbytes: int, generation: int
    ) -> tuple[int, int, int, int]:
        """What the receiver checks before a bucket's bytes may land."""
        return version, index, nbytes, generation

    def _send_all(
        self,
        conn: socket.socket,
        pending: _Pending,
        data: memoryview,
        generation: int,
        tracker: StreamDone,
    ) -> None:
        """Runs in a worker thread: seal and send every bucket of the version, then
        release the slot (here, not on the event loop, which may be busy)."""
        try:
            self._seal_all(conn, pending, data, generation)
        finally:
            tracker.set()

    def _seal_all(
        self, conn: socket.socket, pending: _Pending, data: memoryview, generation: int
    ) -> None:
        layout, chunk = self.cache.layout, self.chunk_bytes
        assert layout is not None
        aead = AESGCM(pending.key)
        out = bytearray(chunk + TAG)
        counter = 0
        deadline = time.monotonic() + self.stream_timeout_s

        def seal(plain: memoryview | bytes) -> None:
            nonlocal counter
            sealed = memoryview(out)[: len(plain) + TAG]
            aead.encrypt_into(_nonce(counter), plain, None, sealed)
            counter += 1
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"stream to {pending.receiver} ran past {self.stream_timeout_s}s"
                )
            conn.settimeout(left)  # sendall's timeout bounds the whole call
            conn.sendall(sealed)

        for index, (start, size) in enumerate(
            zip(layout.bucket_offsets, layout.bucket_sizes, strict=True)
        ):
            seal(_HEADER.pack(*self.bucket_header(pending.version, index, size, generation)))
            bucket = data[start : start + size]
            for off in range(0, max(size, 1), chunk):
                seal(bucket[off : off + chunk])


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


class SealedReceiver:
    """The shard's side of one stream: buckets arrive in order, each opened and checked.

    A chunk is received straight into its place in the bucket buffer and decrypted
    there (AES-GCM in place), so the receiver holds nothing but its bucket buffers.
    """

    def __init__(self, host: str, grant: StreamGrant, timeout: float) -> None:
        self.host, self.grant, self.timeout = host, grant, timeout
        self.aead = AESGCM(grant.key)
        self.counter = 0
        self._conn: socket.socket | None = None

    def connect(self) -> None:
        conn = socket.create_connection((self.host, self.grant.port), timeout=self.timeout)
        conn.settimeout(self.timeout)
        conn.sendall(MAGIC + self.grant.ticket)
        self._conn = conn

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.shutdown(socket.SHUT_RDWR)  # wakes a read blocked in another thread
            self._conn.close()
            self._conn = None

    def _open(self, buf: memoryview, nbytes: int) -> None:
        """Read one sealed chunk of ``nbytes`` into ``buf`` (which has room for its tag)
        and decrypt it in place into ``buf[:nbytes]``."""
        assert self._conn is not None
        sealed = buf[: nbytes + TAG]
        _recv_exact(self._conn, sealed)
        try:
            self.aead.decrypt_into(_nonce(self.counter), sealed, None, buf[:nbytes])
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
        chunk = self.grant.chunk_bytes
        for off in range(0, max(expected, 1), chunk):
            self._open(into[off:], min(chunk, expected - off))
        return version, index, nbytes, generation


def host_of(endpoint: str) -> str:
    """``tcp://HOST:PORT`` -> ``HOST`` (brackets of an IPv6 address removed)."""
    hostport = endpoint.removeprefix("tcp://")
    host = hostport.rsplit(":", 1)[0]
    return host[1:-1] if host.startswith("[") else host


async def receive_sealed(
    endpoint: str,
    grant: StreamGrant,
    layout: Layout,
    buffers: int,
    timeout: float,
    on_bucket: Callable[[int, tuple[int, int, int, int], memoryview], None],
) -> None:
    """Read every bucket of a granted stream; ``on_bucket(index, header, data)`` runs on
    the event loop's thread (where the sink lives) while the next bucket is read.

    ``buffers`` bucket-sized buffers are reused round-robin: with two or more, reading
    bucket i+1 overlaps loading bucket i; the receiver's extra memory stays within
    ``buffers x bucket``.
    """
    if grant.transport != "sealed":
        raise SyncError(f"the owner granted transport {grant.transport!r}; this shard has none")
    receiver = SealedReceiver(host_of(endpoint), grant, timeout)
    sizes = layout.bucket_sizes
    biggest = max(sizes, default=0)
    pool = [bytearray(biggest + TAG) for _ in range(max(1, min(buffers, len(sizes))))]
    try:
        await asyncio.to_thread(receiver.connect)

        def read(i: int) -> asyncio.Future[tuple[int, int, int, int]]:
            view = memoryview(pool[i % len(pool)])
            return asyncio.ensure_future(asyncio.to_thread(receiver.read_bucket, sizes[i], view))

        pending = read(0) if sizes else None
        for i in range(len(sizes)):
            assert pending is not None
            header = await pending
            pending = None
            if i + 1 < len(sizes) and len(pool) > 1 and header[2] == sizes[i]:
                pending = read(i + 1)  # overlaps the load below: another buffer
            try:
                on_bucket(i, header, memoryview(pool[i % len(pool)])[: sizes[i]])
            except BaseException:
                if pending is not None:
                    receiver.close()  # ends the read in flight
                    await asyncio.gather(pending, return_exceptions=True)
                raise
            if pending is None and i + 1 < len(sizes):
                pending = read(i + 1)
    finally:
        receiver.close()
