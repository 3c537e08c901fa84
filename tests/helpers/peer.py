"""A real peer process for transport tests: ``python tests/helpers/peer.py server|client ...``.

Prints ``READY <endpoint>`` once it serves, then runs until killed or told to stop.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from rlix_async.aio import run
from rlix_async.protocol import Message, Ping, Pong
from rlix_async.security import ClientKeys, ServerKeys
from rlix_async.transport import (
    CallContext,
    Reply,
    RpcClient,
    RpcServer,
    TransportConfig,
)


class Sleep(Message):
    seconds: float
    tag: int = 0


class Slept(Message):
    tag: int = 0


class Echo(Message):
    note: str = ""


class Event(Message):
    name: str


class GetEvents(Message):
    pass


class Events(Message):
    names: list[str]


class PushToMe(Message):
    """Ask the server to send the caller a Notice notification and a Question call."""

    text: str


class Notice(Message):
    text: str


class Question(Message):
    text: str


class Answer(Message):
    text: str


class Boom(Message):
    pass


def config_from(args: argparse.Namespace) -> TransportConfig:
    return TransportConfig(
        heartbeat_interval_s=args.hb,
        heartbeat_timeout_s=args.hb * 2.5,
        max_message_bytes=args.max_bytes,
    )


async def serve(args: argparse.Namespace) -> None:
    keys = ServerKeys.load(args.keys) if args.keys else None
    server = RpcServer(args.endpoint, keys=keys, config=config_from(args), name="test-server")
    events: list[str] = []

    async def sleep(msg: Sleep, ctx: CallContext) -> Slept:
        await asyncio.sleep(msg.seconds)
        return Slept(tag=msg.tag)

    async def push(msg: PushToMe, ctx: CallContext) -> Answer:
        await server.notify(ctx.peer, Notice(text=msg.text))
        reply = await server.call(ctx.peer, Question(text=msg.text), timeout=5)
        assert isinstance(reply, Answer)
        return reply

    def boom(msg: Boom, ctx: CallContext) -> None:
        raise RuntimeError("boom handler exploded")

    server.on(Ping, lambda msg, ctx: Pong(seq=msg.seq))
    server.on(Sleep, sleep)
    server.on(Echo, lambda msg, ctx: Reply(msg, [bytes(f) for f in ctx.frames]))
    server.on(Event, lambda msg, ctx: events.append(msg.name))
    server.on(GetEvents, lambda msg, ctx: Events(names=list(events)))
    server.on(PushToMe, push)
    server.on(Boom, boom)
    await server.start()
    print("READY", server.endpoint, flush=True)
    await asyncio.Event().wait()


async def client(args: argparse.Namespace) -> None:
    keys = ClientKeys.load(args.keys) if args.keys else None
    c = RpcClient(args.endpoint, args.identity, keys=keys, config=config_from(args))
    c.on(Question, lambda msg, ctx: Answer(text=msg.text.upper()))
    await c.connect(timeout=20)
    print("READY", args.endpoint, flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["server", "client"])
    p.add_argument("endpoint")
    p.add_argument("--keys")
    p.add_argument("--identity", default="test/client/0")
    p.add_argument("--hb", type=float, default=1.0, help="heartbeat interval (s)")
    p.add_argument("--max-bytes", type=int, default=64 << 20, help="max_message_bytes")
    args = p.parse_args()
    run(serve(args) if args.role == "server" else client(args))


if __name__ == "__main__":
    main()
