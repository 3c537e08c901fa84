"""``launch --node K`` starts a trainer once its pipeline's shards on other nodes joined
(rlix_async/remote_shards.py): which shards, from the whole plan; whether they joined,
from a real coordinator's status, a shard worker being a real client of it."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols.topology import ClusterShape
from rlix_async.remote_shards import remote_shards, wait_remote_shards
from rlix_async.security import ipc_endpoint
from rlix_async.transport import RpcClient

CROSSING = """
out: {out}
cluster: {{nodes: 3, gpus_per_node: 2}}
pipelines:
  - id: near
    model: {{path: /models/m}}
    clusters:
      actor_train: {{tp: 1, devices: [2]}}
      actor_infer: {{tp: 1, devices: [3, 4]}}
  - id: far
    model: {{path: /models/m}}
    clusters:
      actor_train: {{tp: 1, devices: [5]}}
      actor_infer: {{tp: 1, devices: [3]}}
"""


def test_a_node_waits_for_the_shards_elsewhere_of_the_pipelines_it_drives(
    tmp_path: Path,
) -> None:
    from rlix_async.config import LaunchConfig, load_config
    from rlix_async.placement import place_processes

    path = tmp_path / "c.yaml"
    path.write_text(CROSSING.format(out=tmp_path / "out"))
    plan = place_processes(load_config(path, LaunchConfig), tmp_path / "out", "tcp://h:1")
    # near's driver on node 1, its second shard (device 4) on node 2; far's driver on
    # node 2, its shard on node 1; node 0 drives nothing
    assert remote_shards(plan, 0) == {}
    assert remote_shards(plan, 1) == {"near": {1}}
    assert remote_shards(plan, 2) == {"far": {0}}


async def test_the_wait_ends_when_they_join_and_names_the_missing_after_its_timeout() -> None:
    endpoint = ipc_endpoint(f"rs-{uuid.uuid4().hex[:8]}")
    async with Coordinator(endpoint, ClusterShape(1, 4)) as co:
        shard = RpcClient(co.endpoint, "far/infer/0")  # far's shard worker, joined
        await shard.connect(timeout=10)
        try:
            await asyncio.to_thread(wait_remote_shards, {"far": {0}}, co.endpoint, None, 10)
            with pytest.raises(RuntimeError, match=r"not joined after 2s: far/1 \(is their"):
                await asyncio.to_thread(wait_remote_shards, {"far": {0, 1}}, co.endpoint, None, 2.0)
        finally:
            await shard.close()
