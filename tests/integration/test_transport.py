"""Transport over real sockets and real processes (the server runs in tests/helpers/peer.py)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import zmq
from helpers.peer import (
    Answer,
    Boom,
    Echo,
    Event,
    GetEvents,
    Notice,
    PushToMe,
    Question,
    Sleep,
    Slept,
)
from helpers.waits import until

from rlix_async.protocol import ErrorCode, Ok, Ping, Pong, RpcError
from rlix_async.transport import (
    CallTimeout,
    ConnectionLost,
    Deferred,
    RpcClient,
    RpcServer,
    TransportConfig,
)

pytestmark = pytest.mark.usefixtures("steady_gc")  # timed heartbeats (conftest)

FAST = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=0.5, connect_timeout_s=20)


async def test_request_reply_across_processes(spawn, ipc_ep) -> None:
    server = spawn("server", ipc_ep)
    async with RpcClient(server.endpoint, "p0/infer/0") as client:
        reply = await client.call(Ping(seq=41))
        assert reply == Pong(seq=41)
        payload = [b"\x00" * 1_000_000, bytearray(b"abc"), memoryview(b"xyz")]
        msg, frames = await client.call_with_frames(Echo(note="bulk"), payload)
        assert msg == Echo(note="bulk")
        assert [bytes(f) for f in frames] == [bytes(p) for p in payload]


async def test_call_timeout_then_server_still_answers(spawn, ipc_ep) -> None:
    server = spawn("server", ipc_ep)
    async with RpcClient(server.endpoint, "p0/driver/0") as client:
        t0 = time.monotonic()
        with pytest.raises(CallTimeout, match="Sleep"):
            await client.call(Sleep(seconds=2.0), timeout=0.2)
        assert time.monotonic() - t0 < 1.0
        assert await client.call(Sleep(seconds=0.01, tag=3), timeout=5) == Slept(tag=3)
        assert await client.call(Ping(seq=1)) == Pong(seq=1)


async def test_handler_error_is_reported_not_fatal(spawn, ipc_ep) -> None:
    server = spawn("server", ipc_ep)
    async with RpcClient(server.endpoint, "p0/driver/0") as client:
        with pytest.raises(RpcError, match="boom handler exploded") as info:
            await client.call(Boom())
        assert info.value.code == ErrorCode.HANDLER_FAILED
        with pytest.raises(RpcError) as info:
            await client.call(Question(text="not served by the server"))
        assert info.value.code == ErrorCode.NO_HANDLER
        assert await client.call(Ping(seq=2)) == Pong(seq=2)


async def test_notifications_both_ways(spawn, ipc_ep) -> None:
    server = spawn("server", ipc_ep)
    notices: asyncio.Queue[str] = asyncio.Queue()
    client = RpcClient(server.endpoint, "p1/infer/3")
    client.on(Notice, lambda msg, ctx: notices.put_nowait(msg.text))
    client.on(Question, lambda msg, ctx: Answer(text=msg.text[::-1]))
    async with client:
        # worker -> coordinator events
        for name in ("started", "progress", "done"):
            assert await client.notify(Event(name=name))
        events = await client.call(GetEvents())
        assert events.names == ["started", "progress", "done"]
        # coordinator -> worker: a pushed notification and a call served by the client
        answer = await client.call(PushToMe(text="hello"))
        assert answer == Answer(text="olleh")
        assert await asyncio.wait_for(notices.get(), 5) == "hello"


async def test_ten_thousand_concurrent_calls_none_lost(spawn, ipc_ep) -> None:
    server = spawn("server", ipc_ep)
    async with RpcClient(server.endpoint, "p0/driver/0") as client:
        n = 10_000
        replies = await asyncio.wait_for(
            asyncio.gather(
                *(client.call(Sleep(seconds=0.001, tag=i), timeout=60) for i in range(n))
            ),
            timeout=90,
        )
        assert [r.tag for r in replies] == list(range(n))
        pongs = await asyncio.gather(*(client.call(Ping(seq=i)) for i in range(n)))
        assert [p.seq for p in pongs] == list(range(n))


async def test_killed_client_detected_within_three_intervals(spawn, ipc_ep) -> None:
    lost: asyncio.Queue[tuple[str, float]] = asyncio.Queue()
    joined: asyncio.Queue[str] = asyncio.Queue()
    server = RpcServer(
        ipc_ep,
        config=FAST,
        on_peer_joined=lambda p: joined.put_nowait(p.identity),
        on_peer_lost=lambda p: lost.put_nowait((p.identity, time.monotonic())),
    )
    async with server:
        # in a thread: the worker's READY needs this loop to answer its hello
        worker = await asyncio.to_thread(
            spawn, "client", server.endpoint, "--identity", "p0/infer/0", "--hb", "0.2"
        )
        assert await asyncio.wait_for(joined.get(), 10) == "p0/infer/0"
        await asyncio.sleep(0.5)  # it stays alive while it heartbeats
        assert lost.empty()
        killed_at = time.monotonic()
        worker.kill9()
        identity, when = await asyncio.wait_for(lost.get(), 5)
        assert identity == "p0/infer/0"
        assert when - killed_at <= 3 * FAST.heartbeat_interval_s
        assert "p0/infer/0" not in server.peers


def _client_noting_losses(endpoint: str, identity: str) -> tuple[RpcClient, asyncio.Queue[float]]:
    """A FAST client that puts the time of each lost connection on the queue."""
    lost: asyncio.Queue[float] = asyncio.Queue()
    client = RpcClient(
        endpoint,
        identity,
        config=FAST,
        on_disconnected=lambda reason: lost.put_nowait(time.monotonic()),
    )
    return client, lost


async def test_killed_server_detected_by_client(spawn, ipc_ep) -> None:
    server = spawn("server", ipc_ep, "--hb", "0.2")
    client, lost = _client_noting_losses(server.endpoint, "p0/driver/0")
    async with client:
        assert await client.call(Ping(seq=1)) == Pong(seq=1)
        pending = asyncio.ensure_future(client.call(Sleep(seconds=30), timeout=30))
        await asyncio.sleep(0.1)
        killed_at = time.monotonic()
        server.kill9()
        when = await asyncio.wait_for(lost.get(), 5)
        assert when - killed_at <= 3 * FAST.heartbeat_interval_s
        with pytest.raises(ConnectionLost):
            await pending  # in-flight calls fail fast instead of hanging until their timeout


async def test_closing_a_reconnecting_client_fails_the_calls_waiting_for_it(spawn, ipc_ep) -> None:
    """A call made while the client reconnects waits for the reconnect; if the client is
    closed instead (a router replaces a client that is not connected), the call fails
    at once rather than waiting out its timeout: under load the demo's agent pipeline
    hung 600 s on requests waiting for a client that no longer existed."""
    server = spawn("server", ipc_ep, "--hb", "0.2")
    client, lost = _client_noting_losses(server.endpoint, "p0/router/0")
    await client.connect()
    server.kill9()
    await asyncio.wait_for(lost.get(), 5)  # reconnecting to a server that is gone
    assert not client.connected
    waiting = [
        asyncio.ensure_future(client.call(Ping(seq=1), timeout=600)),
        asyncio.ensure_future(client.notify(Ping(seq=2))),
    ]
    await asyncio.sleep(0.3)
    assert not any(w.done() for w in waiting)  # they wait for the reconnect...
    closed_at = time.monotonic()
    await client.close()
    for w in waiting:  # ...and fail as soon as there will be none
        with pytest.raises(ConnectionLost, match="closed"):
            await asyncio.wait_for(w, 5)
    assert time.monotonic() - closed_at < 2


async def test_server_restart_reconnects_and_reregisters(spawn, ipc_ep) -> None:
    server = spawn("server", ipc_ep, "--hb", "0.2")
    registrations: list[str] = []

    async def register(c: RpcClient) -> None:
        await c.notify(Event(name=f"register-{len(registrations)}"))
        registrations.append(c.server_instance or "")

    client = RpcClient(server.endpoint, "p0/driver/0", config=FAST, on_connected=register)
    async with client:
        first_instance = client.server_instance
        server.kill9()
        async with asyncio.timeout(5):  # the client notices the silence...
            while client.connected:  # noqa: ASYNC110  (polls the client's state)
                await asyncio.sleep(0.02)
        # ...and a call made while disconnected waits for the reconnection (one made
        # before the client noticed could fail with ConnectionLost: it was sent)
        call = asyncio.ensure_future(client.call(Ping(seq=7), timeout=20))
        server = spawn("server", ipc_ep, "--hb", "0.2")
        assert await call == Pong(seq=7)
        assert client.server_instance != first_instance
        assert client.reconnects == 1
        assert len(registrations) == 2
        events = await client.call(GetEvents())
        assert events.names == ["register-1"]  # the hook ran again against the new server


async def test_quick_restart_detected_by_new_instance(spawn, ipc_ep) -> None:
    """A server back within the timeout is noticed by its new instance id."""
    server = spawn("server", ipc_ep, "--hb", "0.2")
    hooks: list[int] = []
    rejoined = asyncio.Event()

    def on_connected(c: RpcClient) -> None:
        hooks.append(1)
        if len(hooks) == 2:
            rejoined.set()

    client = RpcClient(
        server.endpoint,
        "p0/driver/0",
        config=TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=30),
        on_connected=on_connected,
    )
    async with client:
        server.kill9()
        server = spawn("server", ipc_ep, "--hb", "0.2")
        await asyncio.wait_for(rejoined.wait(), 10)
        assert client.reconnects == 1
        assert await client.call(Ping(seq=3)) == Pong(seq=3)


async def test_protocol_version_mismatch_refused_at_hello(ipc_ep, monkeypatch) -> None:
    from rlix_async import protocol

    ours = protocol.PROTOCOL_VERSION
    async with RpcServer(ipc_ep) as server:
        monkeypatch.setattr(protocol, "PROTOCOL_VERSION", 99)
        with pytest.raises(
            RpcError, match=f"speaks protocol 99, this server speaks {ours}"
        ) as info:
            await RpcClient(server.endpoint, "old/driver/0").connect(timeout=5)
        assert info.value.code == ErrorCode.VERSION_MISMATCH


async def test_oversized_call_refused_before_sending(ipc_ep) -> None:
    cfg = TransportConfig(max_message_bytes=4096)
    async with RpcServer(ipc_ep, config=cfg) as server:
        server.on(Echo, lambda msg, ctx: Ok())
        async with RpcClient(server.endpoint, "a/b/0", config=cfg) as client:
            with pytest.raises(ValueError, match="exceeds max_message_bytes=4096"):
                await client.call_with_frames(Echo(), [b"x" * 5000])
            assert await client.call(Echo()) == Ok()


async def test_closing_client_is_forgotten_at_once(ipc_ep) -> None:
    left: asyncio.Queue[str] = asyncio.Queue()
    cfg = TransportConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0)
    async with RpcServer(
        ipc_ep, config=cfg, on_peer_lost=lambda p: left.put_nowait(p.identity)
    ) as server:
        client = await RpcClient(server.endpoint, "p0/driver/0", config=cfg).connect()
        assert "p0/driver/0" in server.peers
        await client.close()
        assert await asyncio.wait_for(left.get(), 5) == "p0/driver/0"  # not after 30 s
        assert "p0/driver/0" not in server.peers


async def test_closed_server_removes_its_ipc_socket_file(ipc_ep) -> None:
    """libzmq leaves the file behind; a host running many jobs would collect them."""
    from pathlib import Path

    path = Path(ipc_ep.removeprefix("ipc://"))

    def exists() -> bool:  # a stat on a local socket file: nothing to wait for
        return path.exists()

    async with RpcServer(ipc_ep) as server:
        server.on(Ping, lambda msg, ctx: Pong(seq=msg.seq))
        async with RpcClient(server.endpoint, "a/b/0") as client:
            assert await client.call(Ping(seq=1)) == Pong(seq=1)
        assert exists()
    assert not exists()


async def test_an_answer_to_a_peer_that_is_gone_is_dropped_not_raised(ipc_ep) -> None:
    """A reply or error for a peer that left meanwhile (ROUTER_MANDATORY says
    EHOSTUNREACH) is counted as dropped; it must not surface in the receive loop."""
    from rlix_async.protocol import Error, Kind, encode

    async with RpcServer(ipc_ep) as server:
        server.on(Ping, lambda msg, ctx: Pong(seq=msg.seq))
        parts = [encode(Kind.ERROR, 7, Error(code="x", message="y"))]
        server._answer(b"gone/peer/0", parts, True)
        assert server.stats["dropped_sends"] == 1
        async with RpcClient(server.endpoint, "a/b/0") as client:
            assert await client.call(Ping(seq=2)) == Pong(seq=2)


@pytest.mark.parametrize(("beats_per_tick", "largest_batch"), [(128, 3), (2, 2)])
async def test_heartbeats_are_spread_over_the_interval(
    ipc_ep, monkeypatch: pytest.MonkeyPatch, beats_per_tick: int, largest_batch: int
) -> None:
    """Each peer is beaten once per interval, the peers spread over at least five ticks
    and enough that no tick sends more than BEATS_PER_TICK, rather than all in one
    callback (4,096 sends at once held the loop for tens of ms); no peer, not even
    one that joins mid-round, goes longer than two intervals without one."""
    import rlix_async.transport.server as server_mod

    monkeypatch.setattr(server_mod, "BEATS_PER_TICK", beats_per_tick)
    lost: list[str] = []
    async with RpcServer(
        ipc_ep, config=FAST, on_peer_lost=lambda p: lost.append(p.identity)
    ) as server:
        clients = [
            await RpcClient(server.endpoint, f"p{i}/driver/0", config=FAST).connect()
            for i in range(10)
        ]
        batches: list[list[str]] = []
        beats: dict[str, list[float]] = {}
        real = server._beat

        def recorded(peers: list[str]) -> None:
            batches.append(list(peers))
            now = time.monotonic()
            for peer in peers:
                beats.setdefault(peer, []).append(now)
            real(peers)

        server._beat = recorded  # type: ignore[method-assign]
        await asyncio.sleep(0.5)
        late = await RpcClient(server.endpoint, "late/driver/0", config=FAST).connect()
        joined_at = time.monotonic()
        await asyncio.sleep(1.3)
        end = time.monotonic()
        # 11 peers: ceil(11 / 5) a tick, or at most BEATS_PER_TICK over more ticks
        assert batches and max(map(len, batches)) == largest_batch
        interval = FAST.heartbeat_interval_s
        for c in clients:
            times = beats[c.identity]
            gaps = [b - a for a, b in itertools.pairwise(times)]
            assert max(gaps) <= interval + 2 * interval / 5 + 0.05, gaps  # one per round
            assert end - times[-1] <= interval + 0.1
        first = beats[late.identity][0] - joined_at
        assert first <= 2 * interval + 0.05, first
        assert not lost
        assert all(c.reconnects == 0 for c in [*clients, late])  # nobody thought us dead
        for c in [*clients, late]:
            await c.close()


async def test_server_spreads_connections_over_its_io_threads(ipc_ep) -> None:
    """``io_threads`` sizes the server's ZMQ context (the coordinator's default is 2:
    at 4,096 peers one I/O thread queued calls behind its bursts); calls from many
    peers are answered whichever thread their connection landed on."""
    cfg = TransportConfig(io_threads=2)
    async with RpcServer(ipc_ep, config=cfg) as server:
        server.on(Ping, lambda msg, ctx: Pong(seq=msg.seq))
        assert server._ctx.get(zmq.IO_THREADS) == 2
        clients = [await RpcClient(server.endpoint, f"p{i}/driver/0").connect() for i in range(8)]
        try:
            replies = await asyncio.gather(*(c.call(Ping(seq=i)) for i, c in enumerate(clients)))
            assert replies == [Pong(seq=i) for i in range(8)]
            assert clients[0]._ctx.get(zmq.IO_THREADS) == 1  # a client needs one
        finally:
            for c in clients:
                await c.close()
    with pytest.raises(ValueError, match="io_threads"):
        TransportConfig(io_threads=0)


async def test_a_handler_acts_at_once_and_replies_when_its_deferred_is_answered(ipc_ep) -> None:
    """A sync handler returning a Deferred: messages are acted on in arrival order,
    the reply waits for the Deferred, and a failed one is the caller's error."""
    acted: list[int] = []
    replies: dict[int, Deferred] = {}

    def deferred(msg: Ping, ctx: object) -> Deferred:
        acted.append(msg.seq)
        replies[msg.seq] = Deferred()
        return replies[msg.seq]

    async with RpcServer(ipc_ep) as server:
        server.on(Ping, deferred)
        async with RpcClient(server.endpoint, "a/b/0") as client:
            calls = [asyncio.ensure_future(client.call(Ping(seq=i), timeout=5)) for i in (1, 2)]
            await until(lambda: len(acted) == 2, timeout=5)
            assert acted == [1, 2]
            await asyncio.sleep(0.1)
            assert not any(c.done() for c in calls)  # acted on, not answered
            replies[2].resolve(Pong(seq=2))
            assert await calls[1] == Pong(seq=2)
            assert not calls[0].done()
            replies[1].fail(RpcError("journal", "fsync failed"))
            with pytest.raises(RpcError, match="fsync failed"):
                await calls[0]
