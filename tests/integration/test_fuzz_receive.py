"""Property-based fuzzing of the server's receive path over a real socket.

A raw ZMQ DEALER (no client library, so it can send anything) talks to a server
process. After every hostile message it sends a Ping; the Pong must come back,
and every message the server cannot accept must have produced an Error naming
the problem.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import zmq
from helpers.cluster import Peer, start_peer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlix_async.protocol import (
    Error,
    ErrorCode,
    Kind,
    Ping,
    Pong,
    ProtocolError,
    decode_body,
    decode_envelope,
    encode,
    hello,
)

MAX_BYTES = 65536
IDENTITY = "fuzz/raw/0"


class Raw:
    def __init__(self, endpoint: str, identity: str = IDENTITY) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, identity.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(endpoint)
        self.next_id = 1000

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def ping_collect_errors(self) -> list[Error]:
        """Ping, then read until the Pong: returns the Error replies seen meanwhile."""
        self.next_id += 1
        self.sock.send(encode(Kind.REQUEST, self.next_id, Ping(seq=self.next_id)))
        errors: list[Error] = []
        while True:
            env = decode_envelope(self.sock.recv())  # RCVTIMEO: a dead server fails here
            if env.kind == Kind.HEARTBEAT:
                continue
            msg = decode_body(env)
            if isinstance(msg, Pong) and env.call_id == self.next_id:
                return errors
            assert isinstance(msg, Error), msg
            if msg.code == ErrorCode.NOT_REGISTERED:  # fail now, not after RCVTIMEO
                pytest.fail(f"the server forgot the raw peer: {msg.message}")
            errors.append(msg)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture(scope="module")
def server() -> Iterator[Peer]:
    from rlix_async.security import ipc_endpoint

    # The raw DEALER never sends heartbeats, so the server's liveness timeout is set far
    # beyond the module's run: a pause on a loaded machine (hypothesis shrinking, a slow
    # example) must not declare it dead, which would turn every later Ping into NOT_REGISTERED.
    peer = start_peer(
        "server", ipc_endpoint("fuzz-server"), "--max-bytes", str(MAX_BYTES), "--hb", "600"
    )
    yield peer
    peer.proc.kill()
    peer.proc.wait()


@pytest.fixture(scope="module")
def raw(server: Peer) -> Iterator[Raw]:
    r = Raw(server.endpoint)
    r.sock.send(encode(Kind.REQUEST, 1, hello(IDENTITY)))
    assert decode_body(decode_envelope(r.sock.recv())).type_name == "Welcome"
    yield r
    r.close()


def undecodable(header: bytes) -> bool:
    try:
        decode_envelope(header)
    except ProtocolError:
        return True
    return False


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=300), min_size=1, max_size=4))
def test_random_frames(raw: Raw, frames: list[bytes]) -> None:
    raw.send(frames)
    errors = raw.ping_collect_errors()
    if undecodable(frames[0]):
        assert [e.code for e in errors] == [ErrorCode.BAD_FRAME]
        assert "undecodable header" in errors[0].message


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.integers(min_value=0, max_value=2**31), st.data())
def test_truncated_messages(raw: Raw, seq: int, data: st.DataObject) -> None:
    full = encode(Kind.REQUEST, 7, Ping(seq=seq))
    cut = data.draw(st.integers(min_value=0, max_value=len(full) - 1))
    raw.send([full[:cut]])
    errors = raw.ping_collect_errors()
    assert [e.code for e in errors] == [ErrorCode.BAD_FRAME]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(min_size=1, max_size=40).filter(lambda s: s not in ("Ping", "Hello")))
def test_unknown_message_type(raw: Raw, name: str) -> None:
    from rlix_async.protocol import message_type

    if message_type(name) is not None:
        return
    header = msgspec.msgpack.encode([int(Kind.REQUEST), 5, name, {}])
    raw.send([header])
    errors = raw.ping_collect_errors()
    assert [e.code for e in errors] == [ErrorCode.UNKNOWN_TYPE]
    assert repr(name) in errors[0].message


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ({"seq": -1}, "Expected `int` >= 0 - at `$.seq`"),
        ({"seq": "one"}, "Expected `int`, got `str` - at `$.seq`"),
        ([1, 2], "Expected `object`, got `array`"),
    ],
)
def test_invalid_bodies_name_the_field(raw: Raw, body: object, needle: str) -> None:
    raw.send([msgspec.msgpack.encode([int(Kind.REQUEST), 9, "Ping", body])])
    errors = raw.ping_collect_errors()
    assert [e.code for e in errors] == [ErrorCode.INVALID]
    assert needle in errors[0].message and "Ping" in errors[0].message


def test_missing_required_field(raw: Raw) -> None:
    raw.send([msgspec.msgpack.encode([int(Kind.REQUEST), 9, "Sleep", {}])])
    errors = raw.ping_collect_errors()
    assert [e.code for e in errors] == [ErrorCode.INVALID]
    assert "missing required field `seconds`" in errors[0].message


def test_oversized_message(raw: Raw) -> None:
    raw.send([encode(Kind.REQUEST, 11, Ping(seq=1)), b"\0" * (MAX_BYTES + 1)])
    errors = raw.ping_collect_errors()
    assert [e.code for e in errors] == [ErrorCode.TOO_LARGE]
    assert f"max_message_bytes={MAX_BYTES}" in errors[0].message


def test_garbage_before_hello_is_answered(server: Peer) -> None:
    stranger = Raw(server.endpoint, identity="fuzz/stranger/0")
    try:
        stranger.send([b"\xc1garbage"])
        assert decode_body(decode_envelope(stranger.sock.recv())).code == ErrorCode.BAD_FRAME
        stranger.send([encode(Kind.REQUEST, 3, Ping(seq=3))])
        err = decode_body(decode_envelope(stranger.sock.recv()))
        assert err.code == ErrorCode.NOT_REGISTERED and "has not said hello" in err.message
    finally:
        stranger.close()
