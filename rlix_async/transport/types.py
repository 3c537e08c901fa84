"""The transport's plain types: its settings, what a handler learns about a call, a
reply with frames, what a server knows of a peer, and the errors a call can raise."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlix_async.protocol import Message
from rlix_async.security import Principal

Buffer = bytes | bytearray | memoryview


class CallTimeout(TimeoutError):
    """No reply within the call's timeout."""


class ConnectionLost(ConnectionError):
    """The peer was declared dead (or restarted) while the call was in flight."""


@dataclass(frozen=True)
class TransportConfig:
    heartbeat_interval_s: float = 1.0
    # A peer silent this long is dead. Checked every interval/5, so a killed peer
    # is detected within timeout + interval/5 (2.7 intervals by default).
    heartbeat_timeout_s: float = 2.5
    call_timeout_s: float = 30.0
    max_message_bytes: int = 64 << 20
    sndhwm: int = 10_000
    rcvhwm: int = 10_000
    max_concurrent_handlers: int = 4096
    send_timeout_s: float = 5.0
    connect_timeout_s: float = 30.0
    # ZMTP pings on the server's connections, timeout the same: a connection whose
    # host vanished without closing it (power, partition) keeps its identity up to
    # twice this, and a replacement's hello waits that long (well within
    # connect_timeout_s). Liveness is the heartbeats above, not this.
    socket_heartbeat_s: float = 10.0
    # ZMQ I/O threads of this endpoint's context: a socket's connections are spread
    # over them (a server with thousands of peers; a client needs one).
    io_threads: int = 1

    @classmethod
    def with_heartbeat(cls, interval_s: float, **kw: Any) -> TransportConfig:
        """Heartbeats every ``interval_s``; a peer silent 2.5 intervals is dead."""
        return cls(heartbeat_interval_s=interval_s, heartbeat_timeout_s=2.5 * interval_s, **kw)

    def __post_init__(self) -> None:
        for name in (
            "heartbeat_interval_s",
            "heartbeat_timeout_s",
            "call_timeout_s",
            "socket_heartbeat_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            # the server beats each peer once a round, spread over the round: a peer
            # that joins mid-round hears its first beat up to two intervals later
            raise ValueError("heartbeat_timeout_s must be at least 2 x heartbeat_interval_s")
        if self.max_message_bytes < 1024 or self.max_concurrent_handlers < 1:
            raise ValueError("max_message_bytes >= 1024 and max_concurrent_handlers >= 1")
        if self.io_threads < 1:
            raise ValueError("io_threads must be >= 1")


@dataclass(slots=True)
class CallContext:
    """What a handler learns about the message it serves."""

    peer: str
    call_id: int  # 0 for notifications
    frames: list[memoryview] = field(default_factory=list)
    # The caller's key and role on a keyed (tcp) server; None on ipc, where every
    # peer is the local user.
    principal: Principal | None = None


@dataclass
class Reply:
    """A handler's reply carrying binary frames after the message."""

    msg: Message
    frames: Sequence[Buffer] = ()
    # Called with the ZMQ MessageTracker of the zero-copy send, for owners that
    # must not reuse the frames' memory before ZMQ is done with it.
    on_sent: Callable[[Any], None] | None = None


class Deferred:
    """The reply of a sync handler that has acted but answers later (the coordinator's
    release: after the fsync it shares with the other calls of its loop turn). The
    handler returns it; :meth:`resolve` or :meth:`fail` sends the answer at once, in
    the calling callback (an asyncio future's callbacks would wait for another
    turn of the loop)."""

    __slots__ = ("_on_done", "_outcome")

    def __init__(self) -> None:
        self._on_done: Callable[[Any, Exception | None], None] | None = None
        self._outcome: tuple[Any, Exception | None] | None = None

    def resolve(self, reply: Any) -> None:
        self._finish(reply, None)

    def fail(self, exc: Exception) -> None:
        self._finish(None, exc)

    def on_done(self, callback: Callable[[Any, Exception | None], None]) -> None:
        """The transport's: ``callback(reply, exception)`` once it is answered."""
        self._on_done = callback
        if self._outcome is not None:
            callback(*self._outcome)

    def _finish(self, reply: Any, exc: Exception | None) -> None:
        if self._outcome is not None:
            return  # answered once
        self._outcome = (reply, exc)
        if self._on_done is not None:
            self._on_done(reply, exc)


Handler = Callable[[Any, CallContext], Any]


@dataclass
class PeerInfo:
    identity: str
    host: str
    pid: int
    info: dict[str, Any]
    joined_at: float
    last_seen: float
    rejoined: bool = False
    key: bytes | None = None  # the CURVE key it said hello with (keyed servers)
    principal: Principal | None = None
