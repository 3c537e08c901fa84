"""The receiver's side of a weight stream (``weights/stream.py`` is the owner's, and
says what travels): one thread per stream reading its buckets in order, each chunk
received into its place in a bucket buffer and, sealed, opened there; one stream failing
ends them all."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from rlix_async.protocols.cache_ref import Layout
from rlix_async.protocols.sinks import SyncError
from rlix_async.weights.stream import (
    BUCKET_HEADER,
    DELTA_HEADER,
    MAGIC,
    MAX_STREAMS,
    STREAM_KINDS,
    TAG,
    StreamGrant,
    chunk_nonce,
    host_of,
)


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
            self.aead.decrypt_into(
                chunk_nonce(self.counter, self.stream), sealed, None, buf[:nbytes]
            )
        except InvalidTag:
            raise SyncError(
                "a weight stream chunk failed authentication (altered, reordered or not "
                "from the owner)"
            ) from None
        self.counter += 1

    def read_bucket(self, expected: int, into: memoryview) -> tuple[int, ...]:
        """One bucket into ``into[:nbytes]`` (``into`` has ``TAG`` bytes more than the
        bucket); returns its header (version, index, nbytes, generation, and for a
        delta grant its encoding) for the caller to check. A whole bucket's nbytes is
        ``expected``; an encoded one's at most that."""
        delta = self.grant.delta_base >= 0
        layout = DELTA_HEADER if delta else BUCKET_HEADER
        raw = bytearray(layout.size + TAG)
        self._open(memoryview(raw), layout.size)
        header = layout.unpack_from(raw)
        nbytes = header[2]
        if nbytes > expected or (nbytes != expected and not delta):
            return header  # never read a size we did not ask for into our buffer
        chunk = self.grant.chunk_bytes if self.aead is not None else max(nbytes, 1)
        for off in range(0, max(nbytes, 1), chunk):
            self._open(into[off:], min(chunk, nbytes - off))
        return header


OnBucket = Callable[[int, tuple[int, ...], memoryview], None]


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

    def read(k: int) -> asyncio.Future[tuple[int, ...]]:
        view = memoryview(pool[k % len(pool)])
        return asyncio.ensure_future(
            asyncio.to_thread(receiver.read_bucket, sizes[indices[k]], view)
        )

    pending: asyncio.Future[tuple[int, ...]] | None = None
    try:
        await asyncio.to_thread(receiver.connect)
        pending = read(0)
        for k, index in enumerate(indices):
            assert pending is not None  # one read is always in flight here
            header = await pending
            pending = None
            more = k + 1 < len(indices)
            if more and len(pool) > 1 and header[2] <= sizes[index]:
                pending = read(k + 1)  # overlaps the load below: another buffer
            got = min(header[2], sizes[index])  # more than the bucket: never read, refused
            on_bucket(index, header, memoryview(pool[k % len(pool)])[:got])
            if pending is None and more:
                pending = read(k + 1)
    finally:
        if pending is not None and not pending.done():
            receiver.close()  # ends the read in flight
            await asyncio.wait([pending])  # its thread has let go of the buffer
        if pending is not None and pending.done() and not pending.cancelled():
            pending.exception()  # retrieved: the stream's first failure is what it raises
