"""``launch --node K`` starts a trainer once its pipeline's shards on other nodes joined
(rlix_async/remote_shards.py): whether they joined, from a real coordinator's status,
a shard worker being a real client of it. (Which shards, from the whole plan:
tests/integration/test_placement.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols.topology import ClusterShape
from rlix_async.remote_shards import RemoteShardsWait
from rlix_async.transport import RpcClient


async def test_the_wait_ends_when_they_join_and_names_the_missing_after_its_timeout(
    tmp_path: Path,
) -> None:
    """Asked as the launcher asks, with a driver key over tcp (a node holds its own
    trainers' driver keys, not an admin key): ready once the wanted shard joined; past
    the timeout, one line naming a shard that never did."""
    from rlix_async.security import ClientKeys, ServerKeys, keygen

    keys = tmp_path / "keys"
    keygen(keys, ["driver-far"], role="driver", pipelines=["far"])
    keygen(keys, ["shard"], role="shard", pipelines=["far"])
    for admin in keys.glob("client.key*"):
        admin.unlink()  # this node has no admin key
    async with Coordinator(
        "tcp://127.0.0.1:0", ClusterShape(1, 4), keys=ServerKeys.load(keys)
    ) as co:
        shard = RpcClient(co.endpoint, "far/infer/0", keys=ClientKeys.load(keys, "shard"))
        await shard.connect(timeout=10)
        try:
            wait = RemoteShardsWait({"far": {0}}, co.endpoint, str(keys), "far", 10)
            deadline = time.monotonic() + 10
            while not await asyncio.to_thread(wait.ready):
                assert time.monotonic() < deadline, "the joined shard was never seen"
                await asyncio.sleep(0.1)
            late = RemoteShardsWait({"far": {0, 1}}, co.endpoint, str(keys), "far", 1.0)
            assert not await asyncio.to_thread(late.ready)
            await asyncio.sleep(1.2)
            with pytest.raises(RuntimeError, match=r"not joined after 1s: far/1 \(is their"):
                await asyncio.to_thread(late.ready)
        finally:
            await shard.close()
