"""The trainer ranks' store, sealed: only a process holding the run's secret may use it.

A ``TCPStore`` admits anyone who reaches its port and reads or writes any key: on a
shared node any user's process could join a step's process group or post a batch.
This store speaks the ``torch.distributed.Store`` interface the ranks need (gloo and
NCCL meet on it, ``train/batches.py`` hands batches over it) through sessions sealed
with AES-256-GCM under a key only holders of the 32-byte secret can derive:

1. the client sends ``MAGIC`` and a fresh nonce; the server answers with its own;
2. both derive the session key, HMAC-SHA256(secret, both nonces), and every frame
   after that is sealed under it with a per-direction counter as the GCM nonce (a
   replayed, reordered or forged frame fails to open);
3. the client's first sealed request proves it knows the secret; the server's reply
   proves the server does. A connection whose handshake is garbage, incomplete
   within ``HANDSHAKE_S``, or whose first frame does not open is closed: nothing is
   read or written for it and the ranks' sessions go on.

The server runs in rank 0's process (one thread per session). At most
``MAX_HANDSHAKES`` connections may be proving themselves at once; a new one evicts
the oldest (a rank's handshake takes milliseconds, so connections held open
without one cannot lock the ranks out). Each thread of a client process gets its
own session, so a blocking ``get`` on one thread never holds up another (rank 0's
heartbeat). Every call has a deadline on the client too (its wait plus a margin,
``CALL_S`` for the others, and TCP keepalive): when rank 0's node vanishes without
closing anything, a rank's next call fails within it instead of hanging.
Requests and replies are msgpack (msgspec); values are bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import secrets
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import msgspec
import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

MAGIC = b"rlixts01"
SECRET_BYTES = 32
NONCE_BYTES = 16
HANDSHAKE_S = 10.0  # a peer that has not finished its handshake by then is dropped
MAX_HANDSHAKES = 32  # connections proving themselves at once; a new one evicts the oldest
MAX_FRAME = 1 << 30  # a step's batch is far smaller
HELLO_FRAME = 64  # a session's first frame: the sealed ["hello"]
CALL_S = 30.0  # a call that does not wait for a key answers in milliseconds
_TO_SERVER, _TO_CLIENT = b"\x00\x00\x00\x00", b"\x00\x00\x00\x01"
_LEN = struct.Struct(">I")


def session_key(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return hmac.new(
        secret, b"rlix-trainer-store" + client_nonce + server_nonce, hashlib.sha256
    ).digest()


class _Channel:
    """One sealed session's framing over a connected socket."""

    def __init__(self, sock: socket.socket, key: bytes, sends: bytes, receives: bytes) -> None:
        self.sock, self.aead = sock, AESGCM(key)
        self.sends, self.receives = sends, receives
        self.sent = self.received = 0

    def send(self, message: Any) -> None:
        plain = msgspec.msgpack.encode(message)  # before the counter moves: may raise
        nonce = self.sends + self.sent.to_bytes(8, "big")
        self.sent += 1
        sealed = self.aead.encrypt(nonce, plain, None)
        self.sock.sendall(_LEN.pack(len(sealed)) + sealed)

    def receive(self, limit: int = MAX_FRAME, deadline: float | None = None) -> Any:
        (size,) = _LEN.unpack(_read(self.sock, _LEN.size, deadline))
        if size > limit:
            raise ConnectionError(f"a frame of {size} bytes")
        nonce = self.receives + self.received.to_bytes(8, "big")
        self.received += 1
        sealed = _read(self.sock, size, deadline)
        return msgspec.msgpack.decode(self.aead.decrypt(nonce, sealed, None))


def _read(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """``n`` bytes; by ``deadline`` (monotonic) when given, however slowly they drip."""
    out = bytearray()
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("too slow")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise ConnectionError("the peer closed the connection")
        out += chunk
    return bytes(out)


def client_session(sock: socket.socket, secret: bytes) -> _Channel:
    """The client's side of a session on a connected socket: its hello and nonce out,
    the server's nonce in, both sealed directions keyed from ``secret`` (the first
    frame sent on it must be the sealed ``["hello"]``)."""
    ours = secrets.token_bytes(NONCE_BYTES)
    sock.sendall(MAGIC + ours)
    theirs = _read(sock, NONCE_BYTES)
    return _Channel(sock, session_key(secret, ours, theirs), _TO_SERVER, _TO_CLIENT)


class StoreServer:
    """Rank 0's sealed store: keys and values in memory, served on ``host:port`` (port 0:
    any free one) to sessions that hold ``secret``."""

    def __init__(
        self,
        secret: bytes,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        handshake_s: float = HANDSHAKE_S,
        max_handshakes: int = MAX_HANDSHAKES,
    ) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"the store's secret is {SECRET_BYTES} bytes")
        self.secret, self.handshake_s = secret, handshake_s
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self.max_handshakes = max_handshakes
        self._pending: dict[socket.socket, None] = {}  # proving themselves, oldest first
        self._lock = threading.Lock()
        self.refused = 0  # connections closed before or at their first frame
        self._listener = socket.create_server((host, port), backlog=64)
        self.host, self.port = host, self._listener.getsockname()[1]
        threading.Thread(target=self._accept, name="trainer-store", daemon=True).start()

    def close(self) -> None:
        self._listener.close()

    def stored_keys(self) -> list[str]:
        with self._changed:
            return list(self._data)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            with self._lock:
                if len(self._pending) >= self.max_handshakes:  # the oldest makes room
                    oldest = next(iter(self._pending))
                    del self._pending[oldest]
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)  # its thread's read fails now
                self._pending[conn] = None
            try:
                threading.Thread(target=self._session, args=(conn,), daemon=True).start()
            except RuntimeError:  # no thread to spare: this connection goes
                self._settled(conn, refused=True)
                conn.close()

    def _settled(self, conn: socket.socket, refused: bool) -> None:
        with self._lock:
            self._pending.pop(conn, None)
            self.refused += refused

    def _session(self, conn: socket.socket) -> None:
        with conn:
            try:
                channel = self._handshake(conn)
            except (OSError, ConnectionError, InvalidTag, ValueError, msgspec.DecodeError):
                self._settled(conn, refused=True)
                return
            self._settled(conn, refused=False)
            try:
                while True:
                    channel.send(self._serve(channel.receive()))
            except (OSError, ConnectionError, InvalidTag, msgspec.DecodeError):
                return  # the rank left (or its stream broke): its session ends

    def _handshake(self, conn: socket.socket) -> _Channel:
        deadline = time.monotonic() + self.handshake_s
        hello = _read(conn, len(MAGIC) + NONCE_BYTES, deadline)
        if not hmac.compare_digest(hello[: len(MAGIC)], MAGIC):
            raise ValueError("not a trainer-store client")
        ours = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(ours)
        key = session_key(self.secret, hello[len(MAGIC) :], ours)
        channel = _Channel(conn, key, _TO_CLIENT, _TO_SERVER)
        first = channel.receive(HELLO_FRAME, deadline)  # opens only under the secret's key
        if first != ["hello"]:
            raise ValueError("a session starts with hello")
        conn.settimeout(None)  # a rank may block in get() as long as it likes
        channel.send(self._serve(first))
        return channel

    def _serve(self, request: Any) -> list[Any]:
        """One request's reply: ["ok", result] or ["timeout"|"error", message]."""
        try:
            op, *args = request
            handler: Any = self._ops[op]
            return ["ok", handler(self, *args)]
        except TimeoutError as exc:
            return ["timeout", str(exc)]
        except (KeyError, TypeError, ValueError) as exc:
            return ["error", f"bad request: {type(exc).__name__}"]

    def _await(self, keys: list[str], timeout_s: float) -> None:
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise TypeError("keys")
        with self._changed:
            if not self._changed.wait_for(lambda: all(k in self._data for k in keys), timeout_s):
                raise TimeoutError(f"keys {keys[:3]} not set within {timeout_s:.0f} s")

    def _set(self, key: str, value: bytes) -> None:
        if not isinstance(key, str) or not isinstance(value, bytes):
            raise TypeError("set")
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def _get(self, key: str, timeout_s: float) -> bytes:
        self._await([key], float(timeout_s))
        return self._data[key]

    def _add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._data.get(key, b"0")) + int(amount)
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def _compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        with self._changed:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._data[key] = desired
                self._changed.notify_all()
                return desired
            return current if current is not None else expected

    def _check(self, keys: list[str]) -> bool:
        with self._changed:
            return all(k in self._data for k in keys)

    def _delete(self, key: str) -> bool:
        with self._changed:
            return self._data.pop(key, None) is not None

    def _count(self) -> int:
        with self._changed:
            return len(self._data)

    def _hello(self) -> str:
        return "rlix-trainer-store"

    _ops: dict[str, Any] = {
        "hello": _hello,
        "set": _set,
        "get": _get,
        "add": _add,
        "compare_set": _compare_set,
        "check": _check,
        "wait": _await,
        "delete_key": _delete,
        "num_keys": _count,
    }


class SealedStore(dist.Store):
    """A rank's handle on rank 0's :class:`StoreServer` (each thread its own session)."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: timedelta) -> None:
        super().__init__()
        self.host, self.port, self._secret = host, port, secret
        self.set_timeout(timeout)
        self._local = threading.local()
        self._channel()  # fails here, in one line, when the server is not rank 0's

    def _channel(self) -> _Channel:
        channel: _Channel | None = getattr(self._local, "channel", None)
        if channel is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=HANDSHAKE_S)
                channel = client_session(sock, self._secret)
            except OSError as exc:
                raise dist.DistNetworkError(
                    f"trainer store {self.host}:{self.port}: {exc}"
                ) from None
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            self._local.channel = channel
            self._exchange(channel, "hello")  # every session opens with it
        return channel

    def _exchange(self, channel: _Channel, op: str, *args: Any, wait_s: float = 0.0) -> Any:
        """One request and its reply, within ``wait_s`` (the server's own wait for a
        key) plus ``CALL_S``."""
        try:
            channel.sock.settimeout(wait_s + CALL_S)
            channel.send([op, *args])
            status, result = channel.receive()
        except (OSError, ConnectionError, InvalidTag, ValueError) as exc:
            self._local.channel = None
            channel.sock.close()
            why = str(exc) or "its reply did not open under the run secret"
            raise dist.DistNetworkError(
                f"trainer store {self.host}:{self.port}: {type(exc).__name__}: {why}"
            ) from None
        if status != "ok":
            raise dist.DistStoreError(f"trainer store: {result}")
        return result

    def _call(self, op: str, *args: Any, wait_s: float = 0.0) -> Any:
        return self._exchange(self._channel(), op, *args, wait_s=wait_s)

    def _timeout_s(self, timeout: timedelta | None = None) -> float:
        return (timeout if timeout is not None else self.timeout).total_seconds()

    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        wait = self._timeout_s()
        return bytes(self._call("get", key, wait, wait_s=wait))

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key, amount))

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        def raw(v: bytes | str) -> bytes:
            return v.encode() if isinstance(v, str) else bytes(v)

        return bytes(self._call("compare_set", key, raw(expected), raw(desired)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait = self._timeout_s(timeout)
        self._call("wait", list(keys), wait, wait_s=wait)

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete_key", key))

    def num_keys(self) -> int:
        return int(self._call("num_keys"))
