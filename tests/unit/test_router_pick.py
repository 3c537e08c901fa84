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

from helpers.waits import until

from rlix_async.protocol import RpcError
from rlix_async.protocols.generation import Generate, GenerateResult, Sampling, ShardRefusal
from rlix_async.shards.router import Router
from rlix_async.transport import ConnectionLost


class Pipeline:
    """PipelineClient's surface the router reads (see the module docstring)."""

    pipeline_id = "P"
    data_keys: dict[int, str] = {}

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
    ``synced`` >= the request's min_version, and refuses as behind before that."""

    connected = True

    def __init__(self, rank: int) -> None:
        self.rank, self.synced, self.asked = rank, 0, 0

    async def call(self, msg: Generate, timeout: float) -> GenerateResult:
        self.asked += 1
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
