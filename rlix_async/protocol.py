"""Typed, versioned messages on msgpack.

Every message on the wire is one header frame, optionally followed by binary
frames that travel untouched (zero-copy bulk payloads). The header is a msgpack
array ``[kind, call_id, type_name, body]``; ``body`` is the msgpack encoding of a
:class:`Message` subclass, decoded and validated (types, required fields, ranges,
``__post_init__`` checks) against the class its ``type_name`` names.

Message classes register themselves by class name when they are defined, so the
control plane, shards and weights modules declare their own messages next to the
code that handles them; the transport only needs this registry.
"""

from __future__ import annotations

import enum
import os
import socket
from typing import Annotated, Any, ClassVar

import msgspec

# Bump when a message changes incompatibly; peers of another version are refused
# at hello with a message that names both versions. 3: ClusterSpec gained ep, which a
# version-2 peer (its structs forbid unknown fields) would refuse mid-registration.
PROTOCOL_VERSION = 3

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
Identity = Annotated[str, msgspec.Meta(min_length=1, max_length=255, pattern=r"^[\w.\-/:]+$")]


class Kind(enum.IntEnum):
    REQUEST = 1
    REPLY = 2
    ERROR = 3
    NOTIFY = 4
    HEARTBEAT = 5


class ErrorCode(enum.StrEnum):
    BAD_FRAME = "bad_frame"  # header undecodable or not a valid envelope
    TOO_LARGE = "too_large"  # message over max_message_bytes
    UNKNOWN_TYPE = "unknown_type"  # no registered message of that name
    INVALID = "invalid"  # body failed validation
    NO_HANDLER = "no_handler"  # known message, but this peer does not serve it
    VERSION_MISMATCH = "version_mismatch"
    NOT_REGISTERED = "not_registered"  # request before hello (e.g. after a server restart)
    HANDLER_FAILED = "handler_failed"  # the handler raised
    UNKNOWN_CALL = "unknown_call"  # a reply for a call id nobody waits for
    FORBIDDEN = "forbidden"  # the caller's key or identity may not do this


_REGISTRY: dict[str, type[Message]] = {}


class Message(msgspec.Struct, kw_only=True):
    """Base of every wire message; subclasses register under their class name."""

    type_name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__name__
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__module__ + existing.__qualname__ != (
            cls.__module__ + cls.__qualname__
        ):
            raise TypeError(f"message name {name!r} already registered by {existing.__module__}")
        cls.type_name = name
        _REGISTRY[name] = cls


def message_type(name: str) -> type[Message] | None:
    return _REGISTRY.get(name)


class Envelope(msgspec.Struct, array_like=True):
    # A plain int (compared against Kind): building an enum per message costs
    # microseconds on the hot path.
    kind: Annotated[int, msgspec.Meta(ge=1, le=5)]
    call_id: NonNegInt
    type_name: Annotated[str, msgspec.Meta(max_length=128)]
    body: msgspec.Raw


class RpcError(Exception):
    """An error that crosses the wire: a handler raises it, the caller receives it.

    ``code`` is one of :class:`ErrorCode` for transport problems, or a short
    string chosen by the application (e.g. ``"bad_topology"``).
    """

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"[{code}] {detail}")
        self.code = str(code)
        self.detail = detail


class ProtocolError(RpcError):
    """A message that cannot be accepted; the sender gets an Error naming why."""


_encoder = msgspec.msgpack.Encoder()
_envelope_decoder = msgspec.msgpack.Decoder(Envelope)
_body_decoders: dict[type[Message], msgspec.msgpack.Decoder[Any]] = {}


def encode(kind: Kind | int, call_id: int, msg: Message) -> bytes:
    # One msgpack pass: the tuple writes the Envelope's array with the body nested,
    # the same bytes as encoding the body first and wrapping it (test_protocol).
    return _encoder.encode((kind, call_id, msg.type_name, msg))


def decode_envelope(header: bytes | memoryview) -> Envelope:
    try:
        return _envelope_decoder.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"undecodable header: {exc}") from None


def decode_body(env: Envelope) -> Message:
    cls = _REGISTRY.get(env.type_name)
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {env.type_name!r}")
    dec = _body_decoders.get(cls)
    if dec is None:
        dec = _body_decoders[cls] = msgspec.msgpack.Decoder(cls)
    try:
        return dec.decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(ErrorCode.INVALID, f"invalid {env.type_name}: {exc}") from None


# --- transport-level messages -------------------------------------------------


class Heartbeat(Message):
    """Liveness beacon. ``instance`` changes when the sender restarts."""

    instance: str = ""


class Hello(Message):
    protocol: int
    identity: Identity
    host: str = ""
    pid: NonNegInt = 0
    info: dict[str, Any] = {}


class Welcome(Message):
    protocol: int
    server_instance: str
    heartbeat_interval_s: PosFloat
    heartbeat_timeout_s: PosFloat


class Bye(Message):
    """A client closing on purpose: the server forgets it now, not after a timeout."""


class Error(Message):
    code: str
    message: str


class Ping(Message):
    seq: NonNegInt = 0


class Pong(Message):
    seq: NonNegInt = 0


class Ok(Message):
    """Generic empty acknowledgement."""


def hello(identity: str, **info: Any) -> Hello:
    return Hello(
        protocol=PROTOCOL_VERSION,
        identity=identity,
        host=socket.gethostname(),
        pid=os.getpid(),
        info=info,
    )
