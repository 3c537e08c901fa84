"""Coordinator and pipeline client in one process, over real ipc sockets."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
from helpers.cluster import joined_pipeline

from rlix_async.config import SchedulerConfig
from rlix_async.control import coordinator as coord_mod
from rlix_async.control.client import PipelineClient
from rlix_async.control.coordinator import Coordinator
from rlix_async.control.messages import DeviceOwner
from rlix_async.control.registry import Registry, RegistryError
from rlix_async.control.snapshot import Grant, Plan
from rlix_async.control.topology import ClusterShape, ClusterSpec, Priority
from rlix_async.observe.status import render
from rlix_async.protocol import RpcError

SHAPE = ClusterShape(nodes=1, gpus_per_node=4)
TOPO = {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))}


async def joined(endpoint: str, pid: str, topo=TOPO) -> PipelineClient:
    return await joined_pipeline(endpoint, pid, topo)


def test_registry_refuses_bad_input() -> None:
    reg = Registry(SHAPE)
    pid = reg.allocate_id("ft")
    with pytest.raises(RegistryError, match="cluster actor_infer: tp=3") as info:
        reg.register(pid, {"actor_infer": ClusterSpec(3, (0, 1, 2))})
    assert info.value.code == "bad_topology"
    reg.register(pid, TOPO)
    with pytest.raises(RegistryError, match="admit before requesting"):
        reg.request(pid, "actor_train", Priority.ACTOR_TRAINING, None)
    reg.admit(pid)
    with pytest.raises(RegistryError, match="GENERATION is requested on actor_infer"):
        reg.request(pid, "actor_train", Priority.GENERATION, None)
    first = reg.request(pid, "actor_train", Priority.ACTOR_TRAINING, None)
    assert reg.request(pid, "actor_train", Priority.ACTOR_TRAINING, None) is first  # idempotent


async def test_bad_topology_is_refused_with_a_clear_error(ipc_ep: str) -> None:
    async with Coordinator(ipc_ep, SHAPE) as co:
        pc = await PipelineClient.connect(co.endpoint, kind="ft")
        assert pc.pipeline_id == "ft-0"
        with pytest.raises(RpcError, match="devices must be sorted and unique") as info:
            await pc.register({"actor_infer": ClusterSpec(1, (1, 0))})
        assert info.value.code == "bad_topology"
        await pc.close()


async def test_gang_waits_for_holder_then_gets_devices(ipc_ep: str) -> None:
    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await joined(co.endpoint, "A")
        b = await joined(co.endpoint, "B")
        assert await a.request("actor_train", "ACTOR_TRAINING", timeout=5) == [0, 1]
        waiting = asyncio.ensure_future(b.request("actor_train", "OLD_LOG_PROBS", timeout=10))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        assert co.status().pipelines[1].requests == {"actor_train": "OLD_LOG_PROBS"}
        await a.release("actor_train")
        assert await waiting == [0, 1]
        assert b.held == {"actor_train": "OLD_LOG_PROBS"}
        await a.close()
        await b.close()


async def test_rollout_shares_and_await_release(ipc_ep: str) -> None:
    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await joined(co.endpoint, "A")
        b = await joined(co.endpoint, "B")
        await a.report_progress(100, 0, force=True)
        await b.report_progress(100, 0, force=True)
        ra = await a.request("actor_infer", "GENERATION", timeout=5)
        rb = await b.request("actor_infer", "GENERATION", timeout=5)
        assert ra and rb
        for _ in range(50):  # both halves settle at two ranks each
            if len(a.active_ranks) == 2 and len(b.active_ranks) == 2:
                break
            await asyncio.sleep(0.05)
        assert sorted(a.active_ranks + b.active_ranks) == [0, 1, 2, 3]
        await a.await_release()
        assert co.registry.pipelines["A"].active == set()
        await a.close()
        await b.close()


async def test_progress_is_sent_in_two_percent_buckets(ipc_ep: str) -> None:
    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await joined(co.endpoint, "A")
        assert await a.report_progress(1000, 0)
        assert not await a.report_progress(1000, 19)  # still bucket 0
        assert await a.report_progress(1000, 20)  # 2%
        assert await a.report_progress(1000, 20, force=True)
        await a.clear_progress()
        assert await a.report_progress(1000, 20)  # a cleared stream always reports
        await asyncio.sleep(0.1)
        assert co.registry.pipelines["A"].remaining() == 980
        await a.close()


async def test_restart_from_journal_keeps_leases(ipc_ep: str, tmp_path: Path) -> None:
    journal = tmp_path / "j.jsonl"
    cfg = SchedulerConfig(lease_timeout_s=30)
    co = await Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg).start()
    a = await joined(co.endpoint, "A")
    await a.request("actor_train", "ACTOR_TRAINING", timeout=5)
    await a.close()
    await co.close()
    # a new coordinator knows A holds devices 0,1 before A says anything
    async with Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg) as co2:
        held = DeviceOwner("A", "actor_train", "ACTOR_TRAINING")
        assert co2.registry.owners()[:2] == [held, held]
        b = await joined(
            co2.endpoint,
            "B",
            {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))},
        )
        waiting = asyncio.ensure_future(b.request("actor_train", "ACTOR_TRAINING", timeout=10))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # A's lease survived the restart
        co2._drop_pipeline("A", "test")
        assert await waiting == [0, 1]
        await b.close()
    assert '"ev":"unregister"' in journal.read_text()


async def test_invalid_plan_is_never_applied(ipc_ep: str, monkeypatch) -> None:
    def broken(snap):  # grants devices nobody asked for
        return Plan(grants=[Grant("A", "actor_train", "ACTOR_TRAINING", [0, 1])])

    async with Coordinator(ipc_ep, SHAPE) as co:
        a = await joined(co.endpoint, "A")
        monkeypatch.setattr(coord_mod, "plan", broken)
        assert co.schedule_once() is None
        assert co.rejected_plans >= 1
        assert co.registry.pipelines["A"].held == {}
        await a.close()


async def test_metrics_and_status_table(ipc_ep: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from rlix_async.observe.metrics import Metrics

    metrics = Metrics(port)
    try:
        async with Coordinator(ipc_ep, SHAPE, on_status=metrics.update) as co:
            a = await joined(co.endpoint, "A")
            await a.request("actor_train", "ACTOR_TRAINING", timeout=5)
            body = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            )
            assert 'rlix_devices_held{pipeline="A",stage="ACTOR_TRAINING"} 2.0' in body.decode()
            from rich.console import Console

            console = Console(record=True, width=120)
            console.print(render(co.status()))
            assert "actor_train:ACTOR_TRAINING" in console.export_text()
            owners = [str(o) for o in co.status().owners[:2]]
            assert owners == ["A/actor_train:ACTOR_TRAINING"] * 2
            await a.close()
    finally:
        metrics.close()


async def test_dead_shard_worker_frees_its_rank(ipc_ep: str) -> None:
    from rlix_async.control import messages as m
    from rlix_async.transport import RpcClient, TransportConfig

    fast = TransportConfig(heartbeat_interval_s=0.1, heartbeat_timeout_s=0.25)
    async with Coordinator(ipc_ep, SHAPE, transport=fast) as co:
        a = await joined(co.endpoint, "A")
        await a.report_progress(100, 0, force=True)
        worker = RpcClient(co.endpoint, "A/infer/3", config=fast)
        worker.on(m.ShardCommand, lambda msg, ctx: m.ShardAck(state=m.ShardState.ACTIVE))
        await worker.connect()
        ranks = await a.request("actor_infer", "GENERATION", timeout=5)
        assert 3 in ranks
        await worker.close()  # silent from now on, as after kill -9 (no goodbye message)
        # the update may arrive while close() runs: wait on the state, not on one change
        async with asyncio.timeout(5):
            while 3 in a.active_ranks:
                await a.wait_ranks_change(timeout=5)
        changed = a.active_ranks
        assert 3 not in changed and 3 not in co.registry.pipelines["A"].active
        await a.close()
