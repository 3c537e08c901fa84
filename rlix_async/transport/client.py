"""DEALER side of the RPC transport: pipeline drivers and shard workers.

A client has a stable identity (``<pipeline>/<role>/<index>``). After connecting
it says hello, then runs its ``on_connected`` hook (the owner's registration).
When the server goes silent for ``heartbeat_timeout_s``, restarts (a heartbeat
from a new server instance), or answers ``not_registered``, the client fails its
in-flight calls with :class:`ConnectionLost`, opens a fresh socket with the same
identity, says hello again and re-runs the hook. Calls made meanwhile wait for
the reconnection (within their own timeout) instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from rlix_async.protocol import (
    Bye,
    Error,
    ErrorCode,
    Heartbeat,
    Kind,
    Message,
    ProtocolError,
    RpcError,
    Welcome,
    decode_body,
    encode,
    hello,
)
from rlix_async.security import ClientKeys, check_endpoint, tcp_only
from rlix_async.transport.endpoint import _call_hook, _Endpoint
from rlix_async.transport.types import Buffer, CallTimeout, ConnectionLost, TransportConfig

log = logging.getLogger(__name__)

HELLO_ATTEMPT_S = 2.0  # longest wait for one hello's answer before a new socket tries

_HANDSHAKE_FAILURES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the server refused our key (not in its authorized/ dir)",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "security mismatch (CURVE on one side only, or wrong server key)",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "security handshake failed",
}


class RpcClient(_Endpoint):
    def __init__(
        self,
        endpoint: str,
        identity: str,
        *,
        config: TransportConfig | None = None,
        keys: ClientKeys | None = None,
        on_connected: Callable[[RpcClient], Any] | None = None,
        on_disconnected: Callable[[str], Any] | None = None,
        info: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(config, f"rpc-client:{identity}")
        check_endpoint(endpoint, keys)
        keys = tcp_only(endpoint, keys)
        self.endpoint = endpoint
        self.identity = identity
        self.keys = keys
        self.on_connected = on_connected
        self.on_disconnected = on_disconnected
        self.info = info or {}
        self.server_instance: str | None = None
        self.reconnects = 0
        self._ready = asyncio.Event()
        self._closing = asyncio.Event()  # wakes callers waiting for a reconnect that is over
        self._setup_task: asyncio.Task[Any] | None = None
        self._reconnect_task: asyncio.Task[Any] | None = None
        self._last_seen = 0.0
        self._monitor: zmq.Socket[Any] | None = None
        self._hb_interval = self.config.heartbeat_interval_s
        self._hb_timeout = self.config.heartbeat_timeout_s

    @property
    def heartbeat_timeout_s(self) -> float:
        """How long a silent peer is tolerated: ours, or the server's (from its welcome)
        where longer, as the server declares a silent client dead only after that."""
        return self._hb_timeout

    @property
    def connected(self) -> bool:
        return self._ready.is_set()

    async def connect(self, timeout: float | None = None) -> RpcClient:
        """Hello and registration hook; raises if the server cannot be reached."""
        self._loop = asyncio.get_running_loop()
        self._open_socket()
        self._tasks.spawn(self._expire_calls(), "call-timeouts")
        self._setup_task = asyncio.current_task()
        try:
            await self._handshake(self.config.connect_timeout_s if timeout is None else timeout)
            if self.on_connected is not None:
                result = self.on_connected(self)
                if asyncio.iscoroutine(result):
                    await result
        except BaseException:
            await self.close()  # a failed connect leaves no socket or task behind
            raise
        finally:
            self._setup_task = None
        self._ready.set()
        self._tasks.spawn(self._heartbeat_loop(), "heartbeat")
        return self

    async def close(self) -> None:
        if self._closed:
            return
        self._closing.set()
        linger = 0
        if self._ready.is_set():  # tell the server now rather than let it time us out
            with contextlib.suppress(zmq.ZMQError):
                if self._try_send([encode(Kind.NOTIFY, 0, Bye())], True):
                    linger = 200  # long enough for the goodbye to leave
        self._ready.clear()
        self._close_monitor()
        await self._close_socket(linger)
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> RpcClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, msg: Message, *, timeout: float | None = None) -> Message:
        return (await self.call_with_frames(msg, (), timeout=timeout))[0]

    async def call_with_frames(
        self, msg: Message, frames: Sequence[Buffer] = (), *, timeout: float | None = None
    ) -> tuple[Message, list[memoryview]]:
        timeout = self.config.call_timeout_s if timeout is None else timeout
        if self._ready.is_set():  # fast path: connected, no retry bookkeeping
            try:
                return await self._call(None, msg, frames, timeout, "server")
            except RpcError as exc:
                if exc.code != ErrorCode.NOT_REGISTERED:
                    raise
        deadline = time.monotonic() + timeout
        while True:
            await self._wait_ready(max(deadline - time.monotonic(), 1e-3), msg)
            remaining = max(deadline - time.monotonic(), 1e-3)
            try:
                return await self._call(None, msg, frames, remaining, "server")
            except RpcError as exc:
                # A restarted server refused the call unseen: safe to send it again
                # once we are registered with it (the reconnect is already under way).
                if (
                    exc.code != ErrorCode.NOT_REGISTERED
                    or asyncio.current_task() is self._setup_task
                ):
                    raise

    async def notify(self, msg: Message, frames: Sequence[Buffer] = ()) -> bool:
        await self._wait_ready(self.config.send_timeout_s, msg)
        return await self._notify(None, msg, frames)

    async def _wait_ready(self, timeout: float, msg: Message) -> None:
        """Until connected (again), or the client is closed: a caller waiting for a
        reconnect that close() ended must not wait out its whole timeout (a router that
        replaces a reconnecting client left its requests hanging for their 600 s)."""
        if self._ready.is_set() or asyncio.current_task() is self._setup_task:
            return
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            async with asyncio.timeout(timeout):
                # connected again, then lost again before this task ran: wait on
                while not self._ready.is_set() and not self._closing.is_set():
                    ready = asyncio.ensure_future(self._ready.wait())
                    try:
                        await asyncio.wait({ready, closing}, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        ready.cancel()
        except TimeoutError:
            raise CallTimeout(
                f"{msg.type_name}: not connected to {self.endpoint} within {timeout}s"
            ) from None
        finally:
            closing.cancel()
        if self._closing.is_set():
            raise ConnectionLost(f"{msg.type_name}: the client of {self.endpoint} was closed")

    # --- socket ---------------------------------------------------------------------

    def _open_socket(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        self._configure(sock)
        sock.setsockopt(zmq.IDENTITY, self.identity.encode())
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.keys is not None:
            self.keys.apply(sock)
            self._monitor = sock.get_monitor_socket(
                zmq.EVENT_HANDSHAKE_FAILED_AUTH
                | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            )
        sock.connect(self.endpoint)
        self._sock = sock
        self._last_seen = time.monotonic()
        self._start_reading()

    def _reopen_socket(self) -> None:
        self._stop_reading()
        self._close_monitor()
        self._sock.close(linger=0)
        self._open_socket()

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def _handshake_failure(self) -> str | None:
        if self._monitor is None:
            return None
        try:
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
        except zmq.Again:
            return None
        code = int(event["event"])
        return _HANDSHAKE_FAILURES.get(code, f"handshake event {code}")

    async def _handshake(self, timeout: float) -> Welcome:
        deadline = time.monotonic() + timeout
        # Short attempts: a hello lost on a connection the server refused (our previous
        # one was still open there) is only retried on a new socket (see below).
        attempt_timeout = min(max(self.config.heartbeat_timeout_s, 0.5), HELLO_ATTEMPT_S)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConnectionError(
                    f"{self.identity}: no answer from {self.endpoint} within {timeout}s "
                    "(is the coordinator running? for tcp: are the keys right? is another "
                    "live process connected under this identity?)"
                )
            try:
                welcome, _ = await self._call(
                    None,
                    hello(self.identity, **self.info),
                    (),
                    min(attempt_timeout, remaining),
                    "server",
                )
            except CallTimeout:
                failure = self._handshake_failure()
                if failure is not None:
                    raise ConnectionRefusedError(f"{self.endpoint}: {failure}") from None
                # The server never hands a live identity over, so a connection made
                # while our previous one was still open there is refused for good:
                # only a new one gets in, once the old is gone.
                self._reopen_socket()
                continue
            except RpcError as exc:
                if exc.code == ErrorCode.VERSION_MISMATCH:
                    raise
                raise ConnectionError(f"{self.endpoint} refused hello: {exc}") from exc
            assert isinstance(welcome, Welcome)
            self.server_instance = welcome.server_instance
            # The server's liveness settings win: beat at least as often as it
            # expects, and do not give up on it sooner than it would on us.
            self._hb_interval = min(self.config.heartbeat_interval_s, welcome.heartbeat_interval_s)
            self._hb_timeout = max(self.config.heartbeat_timeout_s, welcome.heartbeat_timeout_s)
            self._last_seen = time.monotonic()
            return welcome

    # --- inbound ----------------------------------------------------------------------

    def _routed(self, route: Any, parts: list[Any]) -> list[Any]:
        return parts

    def _receive(self, frames: list[Any]) -> None:
        self._last_seen = time.monotonic()
        env = self._dispatch("server", frames, None)
        if env is None or env.kind not in (Kind.HEARTBEAT, Kind.ERROR):
            return
        try:
            msg = decode_body(env)
        except ProtocolError:
            return
        if isinstance(msg, Heartbeat):
            if self.server_instance is not None and msg.instance != self.server_instance:
                self._start_reconnect(f"server restarted (instance {msg.instance})")
        elif isinstance(msg, Error) and msg.code == ErrorCode.NOT_REGISTERED:
            if self.server_instance is not None:
                self._start_reconnect("server does not know us (it restarted)")
        elif isinstance(msg, Error) and env.call_id == 0:
            log.warning("%s: server reported [%s] %s", self.identity, msg.code, msg.message)

    # --- liveness and reconnection --------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        next_beat = 0.0
        while not self._closed:
            self._drain()  # safety net: a missed FD edge can stall a reader for one tick at most
            now = time.monotonic()
            if self._ready.is_set():
                if now - self._last_seen > self._hb_timeout:
                    self._start_reconnect(f"server silent for {now - self._last_seen:.2f}s")
                elif now >= next_beat:
                    next_beat = now + self._hb_interval
                    self._try_send([self._heartbeat], True)
            await asyncio.sleep(self._hb_interval / 5)

    def _start_reconnect(self, reason: str) -> None:
        if self._closed or (self._reconnect_task is not None and not self._reconnect_task.done()):
            return
        log.warning("%s: lost server (%s); reconnecting", self.identity, reason)
        self._ready.clear()
        self._reconnect_task = self._tasks.spawn(self._reconnect(reason), "reconnect")

    async def _reconnect(self, reason: str) -> None:
        self._fail_pending(f"connection to {self.endpoint} lost: {reason}")
        await _call_hook(self.on_disconnected, reason)
        while not self._closed:
            self._reopen_socket()
            self._setup_task = asyncio.current_task()
            try:
                await self._handshake(self.config.connect_timeout_s)
                if self.on_connected is not None:
                    result = self.on_connected(self)
                    if asyncio.iscoroutine(result):
                        await result
            except Exception as exc:  # keep trying: the server may still be starting
                log.warning("%s: reconnect attempt failed: %s", self.identity, exc)
                await asyncio.sleep(self.config.heartbeat_interval_s)
                continue
            finally:
                self._setup_task = None
            self.reconnects += 1
            self._ready.set()
            log.info(
                "%s: reconnected to %s (instance %s)",
                self.identity,
                self.endpoint,
                self.server_instance,
            )
            return
