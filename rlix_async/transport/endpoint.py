"""Core of the async RPC over ZMQ: one ROUTER server, DEALER clients with stable identities.

Both sides can make calls (request/reply with correlation ids and per-call
timeouts), send one-way notifications, and serve handlers, so the coordinator
pushes commands to workers exactly as workers send events to it. Bulk payloads
ride as extra frames after the header and are handed over as memoryviews of the
received ZMQ frames (zero-copy both ways).

Why a hand-written reader instead of ``zmq.asyncio``: the ZMQ file descriptor is
edge-triggered, and reading it directly from the event loop (drain until EAGAIN,
re-check ``EVENTS`` after every send) saves two futures per message, which is
most of the round-trip budget on a 2-core machine.

Robustness rules:
- nothing that arrives can raise out of the reader: every bad message gets an
  ``Error`` reply naming the problem and the reader carries on;
- heartbeats both ways; a peer silent for ``heartbeat_timeout_s`` is declared
  dead and the owner's ``on_peer_lost`` / ``on_disconnected`` hook runs;
- bounded memory: ZMQ high-water marks on both sockets, a cap on concurrently
  running async handlers (the reader pauses, so backpressure reaches the
  sender's queue), sends to a peer whose queue stays full are dropped after
  ``send_timeout_s``, and messages over ``max_message_bytes`` are refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import inspect
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar, cast

import zmq

from rlix_async.aio import Supervisor
from rlix_async.protocol import (
    Envelope,
    Error,
    ErrorCode,
    Heartbeat,
    Kind,
    Message,
    Ok,
    ProtocolError,
    RpcError,
    decode_body,
    decode_envelope,
    encode,
)
from rlix_async.security import Principal
from rlix_async.transport.types import (
    Buffer,
    CallContext,
    CallTimeout,
    ConnectionLost,
    Deferred,
    Handler,
    Reply,
    TransportConfig,
)

log = logging.getLogger(__name__)
# Plain ints: the enum versions cost microseconds per bitwise operation.
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)


def zmq_fd(sock: zmq.Socket[Any]) -> int:
    """The socket's edge-triggered notification FD (an int option; pyzmq types it int | bytes)."""
    return cast(int, sock.getsockopt(zmq.FD))


_SNDMORE = int(zmq.SNDMORE)
# Call timeouts are enforced by one sweeper at this resolution rather than a
# timer per call: a per-call loop timer costs ~20 us of CPU per round trip here.
_TIMEOUT_RESOLUTION_S = 0.02
M = TypeVar("M", bound=Message)


def _destroy_context(ctx: zmq.Context[Any]) -> None:
    # Runs from GC, at any point of any thread: never block there (zmq's context
    # termination waits for sockets), so tear down on a daemon thread.
    if not ctx.closed:
        threading.Thread(target=ctx.destroy, kwargs={"linger": 0}, daemon=True).start()


def _payload(frames: Sequence[Any]) -> list[memoryview]:
    return [f.buffer for f in frames[1:]] if len(frames) > 1 else []


class _Endpoint:
    """Shared machinery of server and client: reader, dispatch, calls, heartbeats."""

    _sock: zmq.Socket[Any]

    def __init__(self, config: TransportConfig | None, name: str) -> None:
        self.config = config or TransportConfig()
        self.instance = uuid.uuid4().hex[:12]
        self._ctx: zmq.Context[Any] = zmq.Context(io_threads=self.config.io_threads)
        # An endpoint dropped without close() must not hang the interpreter in
        # zmq's context termination (it waits for open sockets): destroy instead.
        weakref.finalize(self, _destroy_context, self._ctx)
        self._handlers: dict[type[Message], tuple[Handler, bool]] = {}
        self._pending: dict[int, asyncio.Future[tuple[Message, list[memoryview]]]] = {}
        # Who each call went to: a reply counts only from that peer (a peer must not
        # answer, or forge an acknowledgement for, a call sent to another).
        self._pending_peer: dict[int, str] = {}
        self._ids = itertools.count(1)
        self._tasks = Supervisor(name)
        self._running_handlers = 0
        self._reading = False
        self._draining = False
        self._edge_check_due = False  # a look at the reader's edge is scheduled
        self._closed = False
        self._deadlines: dict[int, dict[int, tuple[str, str, float]]] = {}
        self._deadline_ticks: list[int] = []  # min-heap of the keys of _deadlines
        self._copied_parts = 1  # leading frames received as bytes (routing id, header)
        self._first_frame: zmq.Frame | None = None
        self._heartbeat = encode(Kind.HEARTBEAT, 0, Heartbeat(instance=self.instance))
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {"errors_sent": 0, "dropped_sends": 0}

    # --- public -----------------------------------------------------------------

    def on(self, msg_type: type[M], handler: Callable[[M, CallContext], Any]) -> None:
        """Serve ``msg_type`` (request or notification); sync or async handler.

        The handler returns a Message (the reply), a :class:`Reply` (reply with
        binary frames) or None (replied as ``Ok``). Raising :class:`RpcError`
        sends its code; any other exception is reported as ``handler_failed``.
        A sync handler may also return a :class:`Deferred`: it acts at once, in the
        order messages arrive, and its reply goes out when the Deferred is resolved
        (the coordinator's, after a shared fsync); a failed one is reported as a
        raised exception would be.
        """
        self._handlers[msg_type] = (handler, inspect.iscoroutinefunction(handler))

    # --- socket plumbing ----------------------------------------------------------

    def _configure(self, sock: zmq.Socket[Any]) -> None:
        c = self.config
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, c.sndhwm)
        sock.setsockopt(zmq.RCVHWM, c.rcvhwm)
        # Hard per-frame cap: ZMQ disconnects a peer beyond it. Frames between the
        # soft and hard limits get a polite too_large error instead.
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * c.max_message_bytes)

    def _start_reading(self) -> None:
        assert self._loop is not None
        if not self._reading and not self._closed:
            self._loop.add_reader(zmq_fd(self._sock), self._drain)
            self._reading = True
            self._loop.call_soon(self._drain)

    def _stop_reading(self) -> None:
        if self._reading and self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(zmq_fd(self._sock))
            self._reading = False

    def _drain(self) -> None:
        """Read everything queued, a bounded batch per loop turn.

        The ZMQ FD is edge-triggered: reading ``EVENTS`` re-arms it, so we check
        it before every read (cheaper than letting recv raise EAGAIN).
        """
        if self._closed or not self._reading:
            return
        sock = self._sock
        self._draining = True
        try:
            for _ in range(256):
                try:
                    if not sock.getsockopt(_EVENTS) & _POLLIN:  # type: ignore[operator,arg-type]  # an int
                        return
                    frames = self._recv_message(sock)
                except zmq.Again:
                    return
                except zmq.ZMQError as exc:
                    if not self._closed:
                        log.error("%s: recv failed: %s", self._tasks.name, exc)
                    return
                try:
                    self._receive(frames)
                except Exception:  # the reader never dies, whatever arrives
                    log.exception("%s: unexpected error handling a message", self._tasks.name)
                if not self._reading:  # paused by backpressure
                    return
        finally:
            self._draining = False
        assert self._loop is not None
        self._loop.call_soon(self._drain)

    def _recv_message(self, sock: zmq.Socket[Any]) -> list[Any]:
        """One multipart message: envelope parts as bytes, payload parts as zero-copy Frames."""
        # Frame.more instead of getsockopt(RCVMORE): pyzmq builds an enum per
        # getsockopt, ~1 us a part.
        frame = sock.recv(_NOBLOCK, copy=False)
        self._first_frame = frame  # a keyed server reads the sender's User-Id from it
        parts: list[Any] = [frame.bytes]
        copied = self._copied_parts
        while frame.more:
            frame = sock.recv(0, copy=False)
            parts.append(frame.bytes if len(parts) < copied else frame)
        return parts

    def _after_send(self) -> None:
        # A send processes socket commands and may consume the FD's edge while a
        # message waits; outside the reader nobody would read it: look again, once
        # per loop turn (reading EVENTS after each of thousands of sends a second
        # costs more than the sends).
        if self._reading and not self._draining and not self._edge_check_due:
            assert self._loop is not None
            self._edge_check_due = True
            self._loop.call_soon(self._check_edge)

    def _check_edge(self) -> None:
        self._edge_check_due = False
        self._drain()  # reads only what EVENTS says is there

    def _try_send(self, parts: list[Any], copy: bool | Callable[[Any], None]) -> bool:
        """One non-blocking send; False when the queue is full.

        ``copy`` may be a callback: the payload goes zero-copy and the callback
        gets the ZMQ MessageTracker that says when its memory is free again.
        """
        try:
            if copy is True:
                # Part by part with int flags: send_multipart's enum arithmetic costs
                # ~1 us a part. Once the first part is queued, ZMQ accepts the rest.
                send = self._sock.send
                for part in parts[:-1]:
                    send(part, _NOBLOCK | _SNDMORE)
                send(parts[-1], _NOBLOCK)
            elif callable(copy):
                copy(self._sock.send_multipart(parts, _NOBLOCK, copy=False, track=True))
            else:
                self._sock.send_multipart(parts, _NOBLOCK, copy=copy)
        except zmq.Again:
            return False
        self._after_send()
        return True

    async def _send_parts(self, parts: list[Any], copy: Any, timeout: float) -> bool:
        """Send, waiting for a full queue to drain for at most ``timeout``."""
        if self._try_send(parts, copy):
            return True
        deadline = time.monotonic() + timeout
        delay = 0.0005
        while time.monotonic() < deadline and not self._closed:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)
            if self._try_send(parts, copy):
                return True
        return False

    # --- inbound ------------------------------------------------------------------

    def _receive(self, frames: list[zmq.Frame]) -> None:
        raise NotImplementedError

    def _dispatch(
        self, peer: str, frames: Sequence[Any], route: Any, principal: Principal | None = None
    ) -> Envelope | None:
        """Decode and act on one message; protocol errors go back as Error replies.

        Returns the envelope (None when it was undecodable) so the subclass can
        look at heartbeats and peer state.
        """
        env: Envelope | None = None
        try:
            size = sum(map(len, frames))
            header = frames[0]
            if len(header) <= self.config.max_message_bytes:
                env = decode_envelope(header)
            if size > self.config.max_message_bytes:
                too_large = ProtocolError(
                    ErrorCode.TOO_LARGE,
                    f"message of {size} bytes exceeds max_message_bytes="
                    f"{self.config.max_message_bytes}",
                )
                fut = self._pending.get(env.call_id) if env is not None else None
                if env is not None and env.kind == Kind.REPLY and fut is not None:
                    if not fut.done():  # our own call's reply: fail it now, not at its timeout
                        fut.set_exception(too_large)
                    return env
                raise too_large
            assert env is not None
            if env.kind in (Kind.REPLY, Kind.ERROR):
                self._resolve(peer, env, frames)
            elif env.kind in (Kind.REQUEST, Kind.NOTIFY):
                self._serve(peer, env, frames, route, principal)
            return env
        except ProtocolError as exc:
            call_id = env.call_id if env is not None and env.kind == Kind.REQUEST else 0
            self._send_error(route, call_id, exc.code, exc.detail)
            return env

    def _resolve(self, peer: str, env: Envelope, frames: Sequence[Any]) -> None:
        fut = self._pending.get(env.call_id)
        if fut is None or fut.done():
            log.debug("late or unknown reply %s for call %d", env.type_name, env.call_id)
            return
        expected = self._pending_peer.get(env.call_id)
        if expected is not None and expected != peer:
            log.warning(
                "%s: reply to call %d from %s ignored: the call went to %s",
                self._tasks.name,
                env.call_id,
                peer,
                expected,
            )
            return
        msg = decode_body(env)
        if env.kind == Kind.ERROR:
            assert isinstance(msg, Error)
            fut.set_exception(RpcError(msg.code, msg.message))
        else:
            fut.set_result((msg, _payload(frames)))

    def _serve(
        self,
        peer: str,
        env: Envelope,
        frames: Sequence[Any],
        route: Any,
        principal: Principal | None = None,
    ) -> None:
        msg = decode_body(env)
        entry = self._handlers.get(type(msg))
        if entry is None:
            raise ProtocolError(ErrorCode.NO_HANDLER, f"{env.type_name} is not served here")
        handler, is_async = entry
        call_id = env.call_id if env.kind == Kind.REQUEST else 0
        ctx = CallContext(peer, call_id, _payload(frames), principal)
        if not is_async:
            try:
                result = handler(msg, ctx)
            except Exception as exc:
                self._handler_failed(route, ctx, msg, exc)
                return
            if isinstance(result, Deferred):
                result.on_done(lambda reply, exc: self._deferred_reply(route, ctx, msg, reply, exc))
            elif ctx.call_id:
                self._send_result(route, ctx.call_id, result)
            return
        self._running_handlers += 1
        if self._running_handlers >= self.config.max_concurrent_handlers:
            self._stop_reading()  # backpressure: the sender's queue fills up instead
        self._tasks.spawn(self._run_async(handler, msg, ctx, route), f"handle-{env.type_name}")

    async def _run_async(
        self, handler: Handler, msg: Message, ctx: CallContext, route: Any
    ) -> None:
        try:
            result = await handler(msg, ctx)
        except Exception as exc:
            self._handler_failed(route, ctx, msg, exc)
        else:
            if ctx.call_id:
                await self._send_result_async(route, ctx.call_id, result)
        finally:
            self._running_handlers -= 1
            if (
                not self._reading
                and not self._closed
                and (self._running_handlers < self.config.max_concurrent_handlers // 2 + 1)
            ):
                self._start_reading()

    def _deferred_reply(
        self, route: Any, ctx: CallContext, msg: Message, reply: Any, exc: Exception | None
    ) -> None:
        if self._closed:
            return
        if exc is not None:
            self._handler_failed(route, ctx, msg, exc)
        elif ctx.call_id:
            self._send_result(route, ctx.call_id, reply)

    def _handler_failed(self, route: Any, ctx: CallContext, msg: Message, exc: Exception) -> None:
        if isinstance(exc, RpcError):
            code, detail = exc.code, exc.detail
        else:
            log.exception("handler for %s from %s failed", msg.type_name, ctx.peer, exc_info=exc)
            code, detail = ErrorCode.HANDLER_FAILED, f"{type(exc).__name__}: {exc}"
        if ctx.call_id:
            self._send_error(route, ctx.call_id, code, detail)
        else:
            log.warning(
                "notification %s from %s failed: [%s] %s", msg.type_name, ctx.peer, code, detail
            )

    def _reply_parts(self, call_id: int, result: Any) -> tuple[list[Any], Any]:
        if isinstance(result, Reply):
            parts = [encode(Kind.REPLY, call_id, result.msg), *result.frames]
            return parts, result.on_sent or False
        if result is None:
            result = Ok()
        if not isinstance(result, Message):
            raise TypeError(f"handler returned {type(result).__name__}, not a Message")
        return [encode(Kind.REPLY, call_id, result)], True

    def _send_result(self, route: Any, call_id: int, result: Any) -> None:
        try:
            parts, copy = self._reply_parts(call_id, result)
        except Exception as exc:
            self._send_error(route, call_id, ErrorCode.HANDLER_FAILED, str(exc))
            return
        self._answer(route, parts, copy)

    async def _send_result_async(self, route: Any, call_id: int, result: Any) -> None:
        try:
            parts, copy = self._reply_parts(call_id, result)
        except Exception as exc:
            self._send_error(route, call_id, ErrorCode.HANDLER_FAILED, str(exc))
            return
        await self._send_or_drop(route, parts, copy)

    def _send_error(self, route: Any, call_id: int, code: str, detail: str) -> None:
        self.stats["errors_sent"] += 1
        parts = [encode(Kind.ERROR, call_id, Error(code=str(code), message=detail))]
        self._answer(route, parts, True)

    def _answer(self, route: Any, parts: list[Any], copy: Any) -> None:
        """Send a reply or an error now, or from a task once the queue drains; a peer
        that is gone meanwhile (EHOSTUNREACH) just loses its answer."""
        try:
            sent = self._try_send(self._routed(route, parts), copy)
        except zmq.ZMQError as exc:
            self.stats["dropped_sends"] += 1
            log.info("dropping answer to %r: %s", route, exc)
            return
        if not sent:
            self._tasks.spawn(self._send_or_drop(route, parts, copy), "answer")

    async def _send_or_drop(self, route: Any, parts: list[Any], copy: Any) -> None:
        try:
            ok = await self._send_parts(
                self._routed(route, parts), copy, self.config.send_timeout_s
            )
        except zmq.ZMQError as exc:  # e.g. EHOSTUNREACH: the peer is gone
            log.info("dropping message to %r: %s", route, exc)
            ok = False
        if not ok:
            self.stats["dropped_sends"] += 1
            log.warning(
                "peer %r did not drain its queue in %.1fs: message dropped",
                route,
                self.config.send_timeout_s,
            )

    def _routed(self, route: Any, parts: list[Any]) -> list[Any]:
        raise NotImplementedError

    # --- outbound calls -------------------------------------------------------------

    async def _call(
        self,
        route: Any,
        msg: Message,
        frames: Sequence[Buffer],
        timeout: float | None,
        peer_name: str,
    ) -> tuple[Message, list[memoryview]]:
        if self._closed:
            raise ConnectionLost(f"{self._tasks.name} is closed")
        timeout = self.config.call_timeout_s if timeout is None else timeout
        call_id = next(self._ids)
        header = encode(Kind.REQUEST, call_id, msg)
        parts = [header, *frames] if frames else [header]
        self._check_size(parts, msg)
        loop = self._loop or asyncio.get_running_loop()
        fut: asyncio.Future[tuple[Message, list[memoryview]]] = loop.create_future()
        self._pending[call_id] = fut
        self._pending_peer[call_id] = peer_name
        tick = int((loop.time() + timeout) / _TIMEOUT_RESOLUTION_S) + 1
        bucket = self._deadlines.get(tick)
        if bucket is None:
            bucket = self._deadlines[tick] = {}
            heapq.heappush(self._deadline_ticks, tick)
        bucket[call_id] = (msg.type_name, peer_name, timeout)
        try:
            routed = self._routed(route, parts)
            # Fast path: a plain non-blocking send; only a full queue needs the retry loop.
            if not self._try_send(routed, not frames) and not await self._send_parts(
                routed, not frames, timeout
            ):
                raise CallTimeout(f"{msg.type_name} to {peer_name}: send queue full for {timeout}s")
            return await fut
        finally:
            bucket.pop(call_id, None)
            self._pending.pop(call_id, None)
            self._pending_peer.pop(call_id, None)

    async def _expire_calls(self) -> None:
        """Fail calls whose deadline passed (the sweeper behind per-call timeouts)."""
        loop = asyncio.get_running_loop()
        ticks = self._deadline_ticks
        while not self._closed:
            await asyncio.sleep(_TIMEOUT_RESOLUTION_S)
            now_tick = int(loop.time() / _TIMEOUT_RESOLUTION_S)
            while ticks and ticks[0] <= now_tick:
                bucket = self._deadlines.pop(heapq.heappop(ticks), {})
                for call_id, (type_name, peer, timeout) in bucket.items():
                    fut = self._pending.get(call_id)
                    if fut is not None and not fut.done():
                        fut.set_exception(
                            CallTimeout(f"{type_name} to {peer}: no reply within {timeout}s")
                        )

    async def _notify(self, route: Any, msg: Message, frames: Sequence[Buffer]) -> bool:
        parts = [encode(Kind.NOTIFY, 0, msg), *frames]
        self._check_size(parts, msg)
        try:
            ok = await self._send_parts(
                self._routed(route, parts), not frames, self.config.send_timeout_s
            )
        except zmq.ZMQError as exc:
            log.info("notification %s to %r not sent: %s", msg.type_name, route, exc)
            return False
        if not ok:
            self.stats["dropped_sends"] += 1
        return ok

    def _check_size(self, parts: list[Any], msg: Message) -> None:
        size = len(parts[0])
        if len(parts) > 1:
            size += sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts[1:])
        if size > self.config.max_message_bytes:
            raise ValueError(
                f"{msg.type_name} of {size} bytes exceeds max_message_bytes="
                f"{self.config.max_message_bytes}"
            )

    def _fail_pending(self, reason: str) -> None:
        for fut in list(self._pending.values()):
            if not fut.done():
                fut.set_exception(ConnectionLost(reason))

    async def _close_socket(self, linger_ms: int = 0) -> None:
        self._closed = True
        self._stop_reading()
        self._fail_pending(f"{self._tasks.name} closed")
        await self._tasks.close()
        sock = getattr(self, "_sock", None)  # absent when start/connect failed early
        if sock is not None:
            sock.close(linger=linger_ms)


async def _call_hook(hook: Callable[..., Any] | None, *args: Any) -> None:
    """Run an owner's hook (sync or async); its failure is logged, never raised here."""
    if hook is None:
        return
    try:
        result = hook(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("hook %s failed", getattr(hook, "__name__", hook))
