"""A base group on real sockets: two LoRA pipelines' drivers, the coordinator, and
the group's shard workers (``g/infer/<rank>``) that serve both members, each
request with its caller's adapter (docs/SCHEDULING.md, "Base groups").

Shard workers run the scripted engine (a test double: several vLLM engines do not
fit this machine; vLLM's own adapter path is tests/integration/test_vllm_lora.py);
adapters travel the real path (shared-memory cache -> sync -> engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from helpers.scripted_engine import ScriptedEngine, adapter_offset
from helpers.waits import until

from rlix_async.control import journal as ev
from rlix_async.control.client import PipelineClient
from rlix_async.control.coordinator import Coordinator
from rlix_async.control.journal import read_journal
from rlix_async.protocol import RpcError
from rlix_async.protocols.generation import Cancel, Generate, Sampling
from rlix_async.protocols.messages import ShardState
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.shards.router import Router
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import RpcClient
from rlix_async.weights.cache import WeightCache

INFER = ClusterSpec(1, (0, 1))
MEMBERS = {"a": ClusterSpec(1, (0,)), "b": ClusterSpec(1, (1,))}


def adapter(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(
            8, 64, generator=g
        ),
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(
            64, 8, generator=g
        ),
    }


ADAPTER_BYTES = 2 * 8 * 64 * 4


E = TypeVar("E")


class Group:
    def __init__(self, co: Coordinator, journal: Path) -> None:
        self.co = co
        self.journal = journal
        self.drivers: dict[str, PipelineClient] = {}
        self.routers: dict[str, Router] = {}
        self.workers: list[ShardWorker] = []
        self.caches: dict[str, WeightCache] = {}

    def events(self, kind: type[E]) -> list[E]:
        return [e for e in read_journal(self.journal) if isinstance(e, kind)]

    def engine(self, rank: int) -> ScriptedEngine:
        engine = self.workers[rank].engine
        assert isinstance(engine, ScriptedEngine)
        return engine

    async def roll_out(self) -> None:
        """Both members ask for rollout; returns once every group shard serves."""
        for pid in ("a", "b"):
            await self.drivers[pid].report_progress(8, 0, force=True)
            await self.drivers[pid].request("actor_infer", "GENERATION", timeout=10)
        await until(lambda: all(w.state == ShardState.ACTIVE for w in self.workers))

    async def publish(self, member: str, version: int) -> None:
        cache = self.caches.setdefault(
            member, WeightCache(member, f"bg{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
        )
        cache.build(version, adapter(version * 10 + ord(member)))
        await self.drivers[member].publish_weights(cache.promote(version))


@contextlib.asynccontextmanager
async def base_group(ipc_ep: str, tmp: Path, token_delay_s: float = 0.01) -> AsyncIterator[Group]:
    journal = tmp / "journal.jsonl"
    async with Coordinator(ipc_ep, ClusterShape(1, 2), journal=journal) as co:
        group = Group(co, journal)
        try:
            for r in range(2):
                engine = ScriptedEngine(token_delay_s=token_delay_s)
                worker = ShardWorker(engine, co.endpoint, "g", r, sleep_level=1, members=["a", "b"])
                group.workers.append(await worker.start())
            for pid, train in MEMBERS.items():
                pc = await PipelineClient.connect(co.endpoint, pipeline_id=pid)
                await pc.register({"actor_train": train, "actor_infer": INFER}, group="g")
                await pc.admit()
                group.drivers[pid] = pc
                group.routers[pid] = Router(pc)
            yield group
        finally:
            for router in group.routers.values():
                await router.close()
            for w in group.workers:
                await w.close()
            for pc in group.drivers.values():
                await pc.close()
            for cache in group.caches.values():
                cache.close()


async def test_one_set_of_shards_serves_both_members_each_with_its_own_adapter(
    ipc_ep: str, tmp_path: Path
) -> None:
    async with base_group(ipc_ep, tmp_path) as g:
        await g.publish("a", 1)
        await g.publish("b", 3)
        for pid in ("a", "b"):
            await g.drivers[pid].report_progress(8, 0, force=True)
        ranks = {
            pid: await g.drivers[pid].request("actor_infer", "GENERATION", timeout=10)
            for pid in ("a", "b")
        }
        assert ranks == {"a": [0, 1], "b": [0, 1]}  # the group's shards, both members
        await until(lambda: all(w.state == ShardState.ACTIVE for w in g.workers))
        held = {"a": 1, "b": 3}
        assert [g.engine(r).adapter_versions for r in range(2)] == [held] * 2
        assert g.engine(0).adapter_bytes == {"a": ADAPTER_BYTES, "b": ADAPTER_BYTES}
        # the coordinator records the versions when the acks arrive, after the
        # workers already serve them
        await until(lambda: g.co.executor.shards.adapters == {("g", 0): held, ("g", 1): held})
        # a group's shard is planned once, not per member
        assert {ch.pipeline for ch in g.events(ev.Expanded)} == {"g"}

        prompt = [3, 4]
        jobs = [
            asyncio.ensure_future(g.routers[pid].generate(prompt, Sampling(max_tokens=20)))
            for pid in ("a", "b")
            for _ in range(4)
        ]
        trajs = await asyncio.gather(*jobs)
        for traj, pid in zip(trajs, ["a"] * 4 + ["b"] * 4, strict=True):
            offset = adapter_offset(pid)
            assert traj.token_ids == [(sum(prompt) + offset + i) % 1000 for i in range(20)]
            assert set(traj.versions) == {held[pid]}
        # both members' requests ran on each shard
        for r in range(2):
            assert {who for who, _ in g.engine(r).served} == {"a", "b"}
        for r in range(2):
            rids = [rid for _, rid in g.engine(r).served]
            assert len(set(rids)) == len(rids)
            assert {rid.split("/")[0] for rid in rids} <= {"a", "b"}


async def test_a_new_adapter_loads_beside_running_requests_and_pauses_nobody(
    ipc_ep: str, tmp_path: Path
) -> None:
    async with base_group(ipc_ep, tmp_path, token_delay_s=0.02) as g:
        await g.publish("a", 1)
        await g.publish("b", 1)
        await g.roll_out()
        for r in range(2):
            g.engine(r).adapter_delay_s = 0.3  # a slow load: nothing may wait for it
        pauses = [g.engine(r).pauses for r in range(2)]
        long_b = asyncio.ensure_future(
            g.routers["b"].generate([5], Sampling(max_tokens=40))
        )  # ~0.8 s
        await until(lambda: sum(g.engine(r).num_running() for r in range(2)) == 1)
        await g.publish("a", 2)
        await until(lambda: all(g.engine(r).adapter_versions.get("a") == 2 for r in range(2)))
        b = await long_b
        assert set(b.versions) == {1} and b.resumes == 0  # b went on, on its own adapter
        assert [g.engine(r).pauses for r in range(2)] == pauses  # no shard paused
        assert all(g.engine(r).adapter_versions["b"] == 1 for r in range(2))
        a = await g.routers["a"].generate([5], Sampling(max_tokens=4), min_version=2)
        assert set(a.versions) == {2}

        def synced() -> list[ev.ShardSynced]:  # journaled as each ack arrives
            return [e for e in g.events(ev.ShardSynced) if e.adapter == "a"]

        await until(lambda: len(synced()) >= 4)
        assert sorted((e.rank, e.version) for e in synced()) == [(0, 1), (0, 2), (1, 1), (1, 2)]
        assert {e.pipeline for e in synced()} == {"g"}


async def test_members_routers_only_and_each_cancels_only_its_own(
    ipc_ep: str, tmp_path: Path
) -> None:
    async with base_group(ipc_ep, tmp_path, token_delay_s=0.02) as g:
        await g.publish("b", 1)
        await g.roll_out()
        shard = g.workers[0].data.endpoint
        with pytest.raises(ConnectionError, match="c/router/x may not use shard g/infer/0"):
            await RpcClient(shard, "c/router/x").connect()
        member_a = await RpcClient(shard, "a/router/x").connect()
        member_b = await RpcClient(shard, "b/router/x").connect()
        try:
            b_job = asyncio.ensure_future(
                member_b.call(
                    Generate(request_id="same", prompt_ids=[1], sampling=Sampling(max_tokens=30))
                )
            )
            await until(lambda: g.engine(0).num_running() == 1)
            await member_a.notify(Cancel(request_ids=["same"]))  # a's "same" is not b's
            reply = await b_job
            assert len(reply.token_ids) == 30 and g.workers[0].cancelled == 0
        finally:
            for c in (member_a, member_b):
                await c.close()


async def test_a_members_training_shrinks_the_group_and_the_others_rollouts_move(
    ipc_ep: str, tmp_path: Path
) -> None:
    async with base_group(ipc_ep, tmp_path, token_delay_s=0.02) as g:
        await g.publish("b", 1)
        await g.roll_out()
        jobs = [
            asyncio.ensure_future(g.routers["b"].generate([i + 1], Sampling(max_tokens=40)))
            for i in range(4)
        ]
        await until(lambda: sum(g.engine(r).num_running() for r in range(2)) == 4)
        devices = await g.drivers["a"].request("actor_train", "ACTOR_TRAINING", timeout=10)
        assert devices == [0]  # a's own training devices, granted to a
        await until(lambda: g.workers[0].state == ShardState.ASLEEP)
        assert g.workers[1].state == ShardState.ACTIVE  # the group keeps its other shard
        trajs = await asyncio.gather(*jobs)
        assert all(len(t.token_ids) == 40 for t in trajs)  # b lost nothing
        assert sum(t.resumes for t in trajs) >= 1  # those on shard 0 moved to shard 1
        shrunk = g.events(ev.Shrunk)
        assert [(e.pipeline, e.ranks) for e in shrunk] == [("g", [0])]


async def test_a_failed_adapter_load_keeps_the_shard_serving_the_others(
    ipc_ep: str, tmp_path: Path
) -> None:
    async with base_group(ipc_ep, tmp_path) as g:
        await g.publish("a", 1)
        await g.publish("b", 1)
        await g.roll_out()
        g.engine(0).adapter_error = True
        await g.publish("a", 2)
        await until(lambda: g.engine(1).adapter_versions["a"] == 2)
        await until(lambda: not g.engine(0).adapter_error)  # shard 0's load did fail
        await asyncio.sleep(0.2)  # time for the coordinator to act on its reply
        assert g.engine(0).adapter_versions == {"a": 1, "b": 1}  # shard 0 kept a's v1
        assert g.workers[0].state == ShardState.ACTIVE
        assert g.co.registry.get("g").active == {0, 1}  # not given up: b still uses it
        # a's request that needs v2 finds the shard that has it
        for _ in range(4):
            traj = await g.routers["a"].generate([2], Sampling(max_tokens=3), min_version=2)
            assert traj.ranks == [1] and set(traj.versions) == {2}


async def test_a_member_without_an_adapter_is_refused_not_served_the_base(
    ipc_ep: str, tmp_path: Path
) -> None:
    async with base_group(ipc_ep, tmp_path) as g:
        await g.publish("a", 1)
        await g.roll_out()
        client = await RpcClient(g.workers[0].data.endpoint, "b/router/x").connect()
        try:
            with pytest.raises(RpcError, match="holds no adapter of b yet") as refused:
                await client.call(
                    Generate(request_id="r", prompt_ids=[1], sampling=Sampling(max_tokens=2))
                )
            assert refused.value.code == "stale_weights"  # the router waits for a sync
            await g.publish("b", 1)
            await until(lambda: g.engine(0).adapter_versions.get("b") == 1)
            reply = await client.call(
                Generate(request_id="r2", prompt_ids=[1], sampling=Sampling(max_tokens=2))
            )
            assert reply.weight_version == 1
        finally:
            await client.close()
        assert all(who == "a" or who == "b" for r in range(2) for who, _ in g.engine(r).served)


async def test_the_last_member_gone_puts_the_groups_shards_to_sleep(
    ipc_ep: str, tmp_path: Path
) -> None:
    async with base_group(ipc_ep, tmp_path) as g:
        await g.publish("a", 1)
        await g.publish("b", 1)
        await g.roll_out()
        await g.drivers["a"].unregister()
        await asyncio.sleep(0.3)
        assert all(w.state == ShardState.ACTIVE for w in g.workers)  # b still uses them
        assert all("a" not in held for held in g.co.executor.shards.adapters.values())
        await g.drivers["b"].unregister()
        await until(lambda: all(w.state == ShardState.ASLEEP for w in g.workers))
        await until(lambda: not g.co.registry.fences)  # confirmed asleep: devices free
        assert "g" not in g.co.registry.pipelines and not g.co.executor.shards.adapters
        shrunk = [e for e in g.events(ev.Shrunk) if e.pipeline == "g"]
        assert sorted(r for e in shrunk for r in e.ranks) == [0, 1]


async def test_a_group_is_no_pipeline_and_its_shards_serve_only_their_members(
    ipc_ep: str, tmp_path: Path
) -> None:
    async with base_group(ipc_ep, tmp_path) as g:
        posing = await PipelineClient.connect(g.co.endpoint, pipeline_id="g")
        outsider = await PipelineClient.connect(g.co.endpoint, pipeline_id="c")
        try:
            with pytest.raises(RpcError, match="g is a base group: act for its members"):
                await posing.unregister()  # e.g. `rlix-async kill g`
            with pytest.raises(RpcError, match=r"base group g serve \['a', 'b'\] only"):
                await outsider.register(
                    {"actor_train": ClusterSpec(1, (0,)), "actor_infer": INFER}, group="g"
                )
            assert g.co.registry.get("g").members == ["a", "b"]
            status = {p.id: p for p in g.co.status().pipelines}  # what `status` shows
            assert status["g"].members == ["a", "b"] and status["g"].group is None
            assert status["a"].group == status["b"].group == "g" and not status["a"].members
        finally:
            await posing.close()
            await outsider.close()


async def test_a_base_group_outlives_a_coordinator_restart_while_its_members_resume(
    ipc_ep: str, tmp_path: Path
) -> None:
    """A base group has no driver of its own: after a restart on the journal its lease
    is its members'. Before, replay marked it lost like a driver's pipeline, nothing
    ever cleared that, and it was dropped at lease expiry under its resumed members;
    every scheduling step then failed (KeyError on the group)."""
    from rlix_async.config import SchedulerConfig

    journal = tmp_path / "journal.jsonl"
    # long enough for the members to resume on a loaded machine (a member not back in
    # time is dropped, rightly, and the group with its last one)
    cfg = SchedulerConfig(lease_timeout_s=4.0)
    drivers: list[PipelineClient] = []
    async with Coordinator(ipc_ep, ClusterShape(1, 2), journal=journal, config=cfg) as co:
        for pid, train in MEMBERS.items():
            pc = await PipelineClient.connect(co.endpoint, pipeline_id=pid)
            await pc.register({"actor_train": train, "actor_infer": INFER}, group="g")
            await pc.admit()
            drivers.append(pc)
    try:
        async with Coordinator(ipc_ep, ClusterShape(1, 2), journal=journal, config=cfg) as co:
            restarted = time.monotonic()
            await until(
                lambda: all(co.registry.pipelines[d.pipeline_id].connected for d in drivers),
                timeout=cfg.lease_timeout_s,
            )
            # past the lease timeout of anything still marked lost since the replay
            await asyncio.sleep(max(0.0, restarted + cfg.lease_timeout_s + 1.0 - time.monotonic()))
            assert co.registry.pipelines["g"].members == ["a", "b"]
            assert co.registry.pipelines["g"].lost_at is None
            co.schedule_once()  # raised KeyError once the group was dropped
            await drivers[0].report_progress(8, 0, force=True)
            assert await drivers[0].request("actor_infer", "GENERATION", timeout=10) == [0, 1]
            assert all(d.failed is None for d in drivers)
    finally:
        for pc in drivers:
            await pc.close()
