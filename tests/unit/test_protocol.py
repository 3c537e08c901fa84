from __future__ import annotations

import msgspec
import pytest

from rlix_async.protocol import (
    ErrorCode,
    Hello,
    Kind,
    Message,
    Ping,
    ProtocolError,
    decode_body,
    decode_envelope,
    encode,
    hello,
    message_type,
)


def test_round_trip() -> None:
    env = decode_envelope(encode(Kind.REQUEST, 42, Ping(seq=7)))
    assert (env.kind, env.call_id, env.type_name) == (Kind.REQUEST, 42, "Ping")
    assert decode_body(env) == Ping(seq=7)


def test_the_header_is_the_envelope_of_the_encoded_body() -> None:
    """encode writes the header in one pass; its bytes must stay those of the
    Envelope around the separately encoded body, which peers of this protocol
    version (and its decoder) expect."""
    from rlix_async.protocol import Envelope
    from rlix_async.protocols.generation import Generate, Sampling

    enc = msgspec.msgpack.Encoder()
    for kind, call_id, msg in [
        (Kind.REQUEST, 1, Ping(seq=3)),
        (Kind.NOTIFY, 0, hello("p/driver/0", role="driver", ranks=[0, 1])),
        (
            Kind.REPLY,
            2**40,
            Generate(
                request_id="r", prompt_ids=[1, 2], sampling=Sampling(max_tokens=8), min_version=4
            ),
        ),
    ]:
        two_pass = enc.encode(Envelope(kind, call_id, msg.type_name, msgspec.Raw(enc.encode(msg))))
        assert encode(kind, call_id, msg) == two_pass


def test_hello_validates_identity() -> None:
    good = decode_envelope(encode(Kind.REQUEST, 1, hello("p0/infer/3")))
    assert isinstance(decode_body(good), Hello)
    raw = msgspec.msgpack.encode([1, 1, "Hello", {"protocol": 1, "identity": "bad id!"}])
    with pytest.raises(ProtocolError, match="invalid Hello") as info:
        decode_body(decode_envelope(raw))
    assert info.value.code == ErrorCode.INVALID


def test_envelope_rejects_bad_kind_and_negative_ids() -> None:
    for bad in ([9, 1, "Ping", {}], [1, -1, "Ping", {}], [1, 1, 5, {}], "x"):
        with pytest.raises(ProtocolError) as info:
            decode_envelope(msgspec.msgpack.encode(bad))
        assert info.value.code == ErrorCode.BAD_FRAME


def test_messages_register_by_name_and_refuse_clashes() -> None:
    class SomethingNew(Message):
        x: int

    assert message_type("SomethingNew") is SomethingNew
    with pytest.raises(TypeError, match="already registered"):
        type("Ping", (Message,), {"__module__": "elsewhere"})


def test_post_init_checks_run_on_decode() -> None:
    class Window(Message):
        lo: int
        hi: int

        def __post_init__(self) -> None:
            if self.lo > self.hi:
                raise ValueError("lo must be <= hi")

    raw = msgspec.msgpack.encode([1, 3, "Window", {"lo": 5, "hi": 1}])
    with pytest.raises(ProtocolError, match="lo must be <= hi"):
        decode_body(decode_envelope(raw))
