"""Which shard the router asks, when the ranks change while a request waits: orderings
that real shards and a real coordinator produce only by chance (a shard refusing a
request as behind just before another shard's host dies and the coordinator's rank
update lands), played here in a fixed order.

Fakes, each because the ordering cannot be forced with the real parts: the pipeline
client (``active_ranks``, ``endpoints``, ``wait_ranks_change`` as
``control/client.py`` has them; the test changes the ranks as an ActiveRanks message
would) and the shard connections (their ``call`` raises what a dead host's connection
raises, ``ConnectionLost``, or the refusal a shard behind on weights sends)."""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers.waits import until

from rlix_async.protocol import RpcError
from rlix_async.protocols.generation import Generate, GenerateResult, Sampling, ShardRefusal
from rlix_async.shards.router import Router
from rlix_async.transport import ConnectionLost


class Pipeline:
    """PipelineClient's surface the router reads (see the module docstring)."""

    pipeline_id = "P"
    data_keys: dict[int, str] = {}
    peer_timeout_s = 0.05  # the coordinator's heartbeat timeout

    def __init__(self) -> None:
        self.active_ranks = [0, 1]
        self.endpoints = {0: "ipc://zero", 1: "ipc://one"}
        self._changed = asyncio.Event()

    async def wait_ranks_change(self, timeout: float) -> list[int]:
        self._changed.clear()
        async with asyncio.timeout(timeout):
            await self._changed.wait()
        return self.active_ranks

    def set_ranks(self, ranks: list[int]) -> None:
        self.active_ranks = ranks
        self.endpoints = {r: e for r, e in self.endpoints.items() if r in ranks}
        self._changed.set()


class Shard:
    """One shard's connection: rank 1's host is gone; rank 0 serves once it holds
    ``synced`` >= the request's min_version, and refuses as behind before that
    (``blips``: its first calls fail as a lost connection would)."""

    connected = True

    def __init__(self, rank: int, blips: int = 0, decode_s: float = 0.0) -> None:
        self.rank, self.synced, self.asked, self.blips = rank, 0, 0, blips
        self.decode_s = decode_s

    async def call(self, msg: Generate, timeout: float) -> GenerateResult:
        self.asked += 1
        await asyncio.sleep(self.decode_s)
        if self.blips:
            self.blips -= 1
            raise ConnectionLost("connection to ipc://zero lost: server silent for 0.50s")
        if self.rank == 1:
            raise ConnectionLost("connection to ipc://one lost: server silent for 0.50s")
        if msg.min_version is not None and self.synced < msg.min_version:
            raise RpcError(ShardRefusal.STALE_WEIGHTS, f"holds {self.synced}")
        n = msg.sampling.max_tokens
        return GenerateResult(msg.request_id, [7] * n, [-1.0] * n, self.synced)

    async def close(self) -> None:
        pass


async def test_a_request_behind_on_its_only_shard_left_is_served_after_the_sync() -> None:
    """Rank 0 refused the request as behind; rank 1 then failed (its host died) and the
    coordinator took it out of the plan. Rank 0, the only shard left, is asked again and
    serves it once it has synced, instead of the request waiting forever for a shard it
    has not been refused by (it stalled a whole pipeline in the multinode test)."""
    pipeline = Pipeline()
    shards = {0: Shard(0), 1: Shard(1)}
    router = Router(pipeline, attempt_timeout_s=30)  # type: ignore[arg-type]

    async def client(rank: int, endpoint: str) -> Shard:
        return shards[rank]

    router._client = client  # type: ignore[assignment, method-assign]
    try:
        pending = asyncio.ensure_future(router.generate([1], Sampling(max_tokens=3), min_version=1))
        await until(lambda: shards[1].asked >= 1)  # refused by 0, then lost on 1
        await asyncio.sleep(0.5)  # past the router's settle: the request waits for a rank
        shards[0].synced = 1  # the sync lands, and the coordinator's update: [0]
        pipeline.set_ranks([0])
        traj = await asyncio.wait_for(pending, 5)
        assert traj.ranks == [0] and traj.versions == [1] * 3 and traj.resumes == 1
    finally:
        await router.close()


@pytest.fixture
def short_suspicion(monkeypatch: pytest.MonkeyPatch) -> float:
    from rlix_async.shards import router

    monkeypatch.setattr(router, "SUSPECT_S", 0.4)
    return 0.4


async def _one_shard(pipeline: Pipeline, shard: Shard) -> Router:
    pipeline.set_ranks([0])
    router = Router(pipeline, attempt_timeout_s=30)  # type: ignore[arg-type]

    async def client(rank: int, endpoint: str) -> Shard:
        return shard

    router._client = client  # type: ignore[assignment, method-assign]
    return router


async def test_a_blip_on_the_only_shard_is_forgiven_after_the_window(
    short_suspicion: float,
) -> None:
    """The connection failed but the coordinator never lost the worker (it stays in the
    plan): the rank is left alone for the window, then asked again."""
    pipeline, shard = Pipeline(), Shard(0, blips=1)
    router = await _one_shard(pipeline, shard)
    try:
        t0 = time.monotonic()
        traj = await asyncio.wait_for(router.generate([1], Sampling(max_tokens=2)), 5)
        assert traj.ranks == [0] and time.monotonic() - t0 >= short_suspicion
    finally:
        await router.close()


async def test_a_rank_that_left_the_plan_and_came_back_is_trusted_at_once(
    short_suspicion: float,
) -> None:
    """A rank served by a new worker (it left the plan and came back, at another
    endpoint) is trusted at once: its predecessor's failure does not hold it."""
    pipeline, shard = Pipeline(), Shard(0, blips=1)
    router = await _one_shard(pipeline, shard)
    try:
        pending = asyncio.ensure_future(router.generate([1], Sampling(max_tokens=2)))
        await until(lambda: shard.asked == 1)
        pipeline.set_ranks([])  # declared dead, then a replacement joins
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        pipeline.endpoints = {0: "ipc://zero-2"}  # a new worker process: a new endpoint
        pipeline.set_ranks([0])
        traj = await asyncio.wait_for(pending, 5)
        assert traj.ranks == [0] and time.monotonic() - t0 < short_suspicion / 2
    finally:
        await router.close()


async def test_requests_queued_behind_a_dead_shards_connect_fail_over_without_connecting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two requests wait to connect to rank 1 (a dead host: its connect runs to its
    timeout); once that connect fails, the one queued behind it goes to rank 0 without
    a connect of its own (each would cost the whole timeout)."""
    from rlix_async.shards import router as router_module

    connects: list[str] = []
    release = asyncio.Event()

    class DeadHost:  # RpcClient to rank 1's endpoint: the connect never gets an answer
        connected = False

        def __init__(self, endpoint: str, identity: str, **_: object) -> None:
            self.endpoint = endpoint

        async def connect(self, timeout: float) -> None:
            connects.append(self.endpoint)
            await release.wait()
            raise ConnectionError(f"no answer from {self.endpoint} within {timeout}s")

        async def close(self) -> None:
            pass

    monkeypatch.setattr(router_module, "RpcClient", DeadHost)
    pipeline = Pipeline()
    zero = Shard(0, decode_s=0.3)  # busy: the least-loaded pick alternates
    router = Router(pipeline, attempt_timeout_s=30)  # type: ignore[arg-type]
    router._clients["ipc://zero"] = zero  # type: ignore[assignment]  # rank 0: connected
    try:
        # least-loaded: the 1st and 3rd go to rank 0, the 2nd and 4th queue on rank 1
        jobs = [
            asyncio.ensure_future(router.generate([i], Sampling(max_tokens=1))) for i in range(4)
        ]
        await until(lambda: len(connects) == 1)
        await asyncio.sleep(0.1)  # the 4th request is queued behind the connect
        release.set()
        trajs = await asyncio.wait_for(asyncio.gather(*jobs), 5)
        assert all(t.ranks[-1] == 0 for t in trajs)
        assert connects == ["ipc://one"]  # the queued request did not connect again
    finally:
        await router.close()
