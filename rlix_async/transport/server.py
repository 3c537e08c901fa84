"""ROUTER side of the RPC transport: the coordinator's socket."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from rlix_async.protocol import (
    PROTOCOL_VERSION,
    Bye,
    Envelope,
    ErrorCode,
    Hello,
    Kind,
    Message,
    ProtocolError,
    RpcError,
    Welcome,
    decode_body,
    decode_envelope,
)
from rlix_async.security import (
    AccessList,
    Principal,
    SecurityError,
    ServerKeys,
    check_endpoint,
    remove_ipc_file,
    tcp_only,
)
from rlix_async.transport.endpoint import _NOBLOCK, _SNDMORE, _call_hook, _Endpoint
from rlix_async.transport.types import Buffer, PeerInfo, TransportConfig

log = logging.getLogger(__name__)

KEY_CHECK_S = 2.0  # how often a keyed server looks for added or revoked keys

# Heartbeats sent in one loop callback at most (about 3 ms of sends): a round's
# peers are spread over as many ticks as that takes.
BEATS_PER_TICK = 128


class RpcServer(_Endpoint):
    """ROUTER side. Peers say hello first; then any message counts as a heartbeat."""

    def __init__(
        self,
        endpoint: str,
        *,
        config: TransportConfig | None = None,
        keys: ServerKeys | None = None,
        on_peer_joined: Callable[[PeerInfo], Any] | None = None,
        on_peer_lost: Callable[[PeerInfo], Any] | None = None,
        name: str = "rpc-server",
    ) -> None:
        super().__init__(config, name)
        check_endpoint(endpoint, keys)
        keys = tcp_only(endpoint, keys)
        self.endpoint = endpoint
        self.keys = keys
        self.peers: dict[str, PeerInfo] = {}
        self.on_peer_joined = on_peer_joined
        self.on_peer_lost = on_peer_lost
        # Asked at every hello with the identity and its info; an RpcError it raises
        # refuses the hello (the peer's connect fails with that message).
        self.admit_peer: Callable[[str, dict[str, Any]], None] | None = None
        self._auth: Any = None
        self._copied_parts = 2  # routing id and header
        self._hello_key: bytes | None = None  # the key of the hello being served

    async def start(self) -> RpcServer:
        self._loop = asyncio.get_running_loop()
        sock = self._ctx.socket(zmq.ROUTER)
        self._configure(sock)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> error, never silent
        # No handover: a newcomer never takes a live peer's identity (and its replies).
        # A peer's own reconnection works once its old connection is gone: a dead
        # process's socket closes at once, a half-open one fails ZMTP heartbeats
        # (libzmq answers them, so a live but busy process keeps its connection),
        # and the client reopens its socket when a hello goes unanswered.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 0)
        # ZMTP pings cost the I/O thread per connection (0.7 of a core at 4,096 peers
        # beaten every second): they only reclaim half-open connections, so they run
        # far slower than the liveness heartbeats above them.
        ivl_ms = int(self.config.socket_heartbeat_s * 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ivl_ms)  # reclaimed within 2 x 10 s
        if self.keys is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve(domain="*", location=str(self.keys.authorized_dir))
            self.keys.apply(sock)
        sock.bind(self.endpoint)
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)  # resolves tcp port 0
        self._sock = sock
        self._start_reading()
        self._tasks.spawn(self._heartbeat_loop(), "heartbeat")
        self._tasks.spawn(self._expire_calls(), "call-timeouts")
        if self.keys is not None:
            self._tasks.spawn(self._watch_keys(), "keys")
        return self

    async def _watch_keys(self) -> None:
        """Follow ``authorized/``: a key added, revoked (``keygen --revoke``) or given
        another role or allowance counts from the next check. A revoked key's peers
        are dropped (their owner hears them lost) and its new connections fail the
        handshake; a peer's role and allowance are the new ones from then on."""
        assert self.keys is not None
        authorized = self.keys.authorized_dir
        seen = AccessList.signature(authorized)
        while not self._closed:
            await asyncio.sleep(KEY_CHECK_S)
            try:
                now = AccessList.signature(authorized)
                if now == seen:
                    continue
                access = AccessList.load(authorized)
            except (OSError, SecurityError, ValueError) as exc:  # mid-write, or bad: keep the old
                log.error("%s: authorized keys not reloaded: %s", self._tasks.name, exc)
                continue
            seen = now
            self.reload_access(access)

    def reload_access(self, access: AccessList) -> None:
        """Serve with ``access`` from now on (see :meth:`_watch_keys`)."""
        assert self.keys is not None
        self.keys = dataclasses.replace(self.keys, access=access)
        if self._auth is not None:  # the handshake: new connections
            self._auth.configure_curve(domain="*", location=str(self.keys.authorized_dir))
        for peer, info in list(self.peers.items()):
            principal = access.principal(info.key)
            if principal is not None and principal.may_use(peer):
                info.principal = principal
                continue
            del self.peers[peer]
            log.warning("peer %s dropped: its key was revoked or no longer allows it", peer)
            self._tasks.spawn(_call_hook(self.on_peer_lost, info), "peer-revoked")

    async def close(self) -> None:
        if self._closed:
            return
        await self._close_socket()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)
        if getattr(self, "_sock", None) is not None:  # bound by us, not by a failed start
            remove_ipc_file(self.endpoint)

    async def __aenter__(self) -> RpcServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(self, peer: str, msg: Message, *, timeout: float | None = None) -> Message:
        return (await self._call(peer.encode(), msg, (), timeout, peer))[0]

    async def call_with_frames(
        self,
        peer: str,
        msg: Message,
        frames: Sequence[Buffer] = (),
        *,
        timeout: float | None = None,
    ) -> tuple[Message, list[memoryview]]:
        return await self._call(peer.encode(), msg, frames, timeout, peer)

    async def notify(self, peer: str, msg: Message, frames: Sequence[Buffer] = ()) -> bool:
        """Push a one-way message; False when the peer is gone or its queue is full."""
        return await self._notify(peer.encode(), msg, frames)

    def _routed(self, route: Any, parts: list[Any]) -> list[Any]:
        return [route, *parts]

    def _receive(self, frames: list[Any]) -> None:
        if len(frames) < 2:
            return  # ZMQ always gives identity + at least one frame; be safe anyway
        route = frames[0]
        try:
            peer = route.decode()
        except UnicodeDecodeError:
            peer = repr(route)
        info = self.peers.get(peer)
        body = frames[1:]
        key: bytes | None = None
        if self.keys is not None:  # tcp: every message names its sender's CURVE key
            key = _user_id(self._first_frame)
        if info is None:
            self._receive_unregistered(peer, route, body, key)
        elif key != info.key:
            # The identity is bound to the key it said hello with: another key's
            # message under it is refused, and never counts as the peer's heartbeat.
            self.stats["forbidden"] = self.stats.get("forbidden", 0) + 1
            self._send_error(
                route,
                0,
                ErrorCode.FORBIDDEN,
                f"identity {peer} belongs to another key: message refused",
            )
        else:
            info.last_seen = time.monotonic()
            self._hello_key = key  # a known peer may say hello again (it reconnected)
            try:
                self._dispatch(peer, body, route, info.principal)
            finally:
                self._hello_key = None

    def _receive_unregistered(
        self, peer: str, route: bytes, body: list[Any], key: bytes | None
    ) -> None:
        """Before hello only Hello is served; anything else is told to say hello."""
        try:
            env = decode_envelope(body[0]) if len(body[0]) < 65536 else None
        except ProtocolError as exc:
            self._send_error(route, 0, exc.code, exc.detail)
            return
        if env is None:
            self._send_error(route, 0, ErrorCode.TOO_LARGE, "oversized message before hello")
        elif env.type_name == Hello.type_name and env.kind == Kind.REQUEST:
            self._hello_key = key
            try:
                self._dispatch(peer, body, route)
            finally:
                self._hello_key = None
        elif env.kind in (Kind.REQUEST, Kind.NOTIFY, Kind.HEARTBEAT):
            call_id = env.call_id if env.kind == Kind.REQUEST else 0
            self._send_error(
                route,
                call_id,
                ErrorCode.NOT_REGISTERED,
                f"{peer} has not said hello to this server (instance {self.instance})",
            )

    def _serve(
        self,
        peer: str,
        env: Envelope,
        frames: Sequence[Any],
        route: Any,
        principal: Principal | None = None,
    ) -> None:
        if env.type_name == Bye.type_name:
            info = self.peers.pop(peer, None)
            if info is not None:
                log.info("peer %s left", peer)
                self._tasks.spawn(_call_hook(self.on_peer_lost, info), "peer-left")
            return
        if env.type_name == Hello.type_name:
            msg = decode_body(env)
            assert isinstance(msg, Hello)
            result = self._hello(peer, msg)
            if env.kind == Kind.REQUEST:
                self._send_result(route, env.call_id, result)
            return
        super()._serve(peer, env, frames, route, principal)

    def _hello(self, peer: str, msg: Hello) -> Welcome:
        if msg.protocol != PROTOCOL_VERSION:
            raise ProtocolError(
                ErrorCode.VERSION_MISMATCH,
                f"peer {peer} speaks protocol {msg.protocol}, this server speaks "
                f"{PROTOCOL_VERSION}: upgrade rlix_async on one side",
            )
        if msg.identity != peer:
            raise ProtocolError(
                ErrorCode.INVALID, f"hello identity {msg.identity!r} != socket identity {peer!r}"
            )
        key, principal = self._hello_key, None
        if self.keys is not None:
            principal = self.keys.access.principal(key)
            if principal is None:  # ZAP let it in, so the list changed since we loaded it
                raise ProtocolError(ErrorCode.FORBIDDEN, f"{peer}: its key is not authorized")
            if not principal.may_use(peer):
                log.error("hello of %s refused: %s may not use it", peer, principal.describe())
                raise ProtocolError(
                    ErrorCode.FORBIDDEN,
                    f"{principal.describe()} may not connect as {peer!r}",
                )
            known = self.peers.get(peer)
            if known is not None and known.key != key:
                raise ProtocolError(
                    ErrorCode.FORBIDDEN, f"identity {peer} is in use by another key"
                )
        if self.admit_peer is not None:
            try:
                self.admit_peer(peer, dict(msg.info))
            except RpcError as exc:
                log.error("hello of %s refused: %s", peer, exc.detail)
                raise ProtocolError(exc.code, exc.detail) from None
        now = time.monotonic()
        rejoined = peer in self.peers
        info = PeerInfo(peer, msg.host, msg.pid, dict(msg.info), now, now, rejoined, key, principal)
        self.peers[peer] = info
        self._tasks.spawn(_call_hook(self.on_peer_joined, info), "peer-joined")
        c = self.config
        return Welcome(
            protocol=PROTOCOL_VERSION,
            server_instance=self.instance,
            heartbeat_interval_s=c.heartbeat_interval_s,
            heartbeat_timeout_s=c.heartbeat_timeout_s,
        )

    def drop_peer(self, peer: str) -> None:
        """Forget a peer without waiting for its heartbeats to stop (e.g. on unregister)."""
        self.peers.pop(peer, None)

    async def _heartbeat_loop(self) -> None:
        """Beat to each peer once per interval, the peers spread over the round's ticks
        (at least five, and enough that a tick sends at most ``BEATS_PER_TICK``: at
        4,096 peers one tick's sends held the loop ~20 ms with a fifth of them each);
        five times per interval, declare silent peers dead."""
        c = self.config
        due: list[str] = []  # this round's peers not beaten to yet
        per_tick, tick = 0, 0.0  # set when each round starts
        next_scan = 0.0
        while not self._closed:
            self._drain()  # safety net: a missed FD edge can stall a reader for one tick at most
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + c.heartbeat_interval_s / 5
                cutoff = now - c.heartbeat_timeout_s
                for peer, info in [(p, i) for p, i in self.peers.items() if i.last_seen < cutoff]:
                    del self.peers[peer]
                    log.warning(
                        "peer %s silent for %.2fs: declared dead", peer, now - info.last_seen
                    )
                    self._tasks.spawn(_call_hook(self.on_peer_lost, info), "peer-lost")
            if not due:  # a new round: everyone listed now, spread over its ticks
                due = list(self.peers)
                ticks = max(5, -(-len(due) // BEATS_PER_TICK))
                per_tick, tick = -(-len(due) // ticks), c.heartbeat_interval_s / ticks
            batch, due = due[:per_tick], due[per_tick:]
            self._beat([peer for peer in batch if peer in self.peers])
            await asyncio.sleep(tick)

    def _beat(self, peers: list[str]) -> None:
        """A heartbeat to each of ``peers``: plain non-blocking sends, and one look at
        the reader's edge after them (``_after_send`` per send would process the
        socket's command queue thousands of times a round)."""
        send, beat = self._sock.send, self._heartbeat
        for peer in peers:
            try:
                send(peer.encode(), _NOBLOCK | _SNDMORE)
                send(beat, _NOBLOCK)
            except zmq.ZMQError:  # queue full or the peer just left: the next round beats
                continue
        if peers:
            self._after_send()


def _user_id(frame: zmq.Frame | None) -> bytes | None:
    """The CURVE key (z85) ZAP gave the connection a frame came on; None if none."""
    if frame is None:
        return None
    try:
        user_id = frame.get("User-Id")
    except zmq.ZMQError:  # no metadata: not a CURVE connection
        return None
    return user_id.encode() if isinstance(user_id, str) else None
