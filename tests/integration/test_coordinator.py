"""Coordinator and pipeline client in one process, over real ipc sockets."""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from helpers.cluster import joined_pipeline

from rlix_async.config import SchedulerConfig
from rlix_async.control import coordinator as coord_mod
from rlix_async.control.client import PipelineClient
from rlix_async.control.coordinator import Coordinator
from rlix_async.control.registry import Registry, RegistryError
from rlix_async.observe.status import render
from rlix_async.protocol import RpcError
from rlix_async.protocols.messages import DeviceOwner, StatusReply, StatusRequest
from rlix_async.protocols.snapshot import Grant, Plan
from rlix_async.protocols.topology import ClusterShape, ClusterSpec, Priority

pytestmark = pytest.mark.usefixtures("steady_gc")  # timed heartbeats (conftest)

SHAPE = ClusterShape(nodes=1, gpus_per_node=4)
TOPO = {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))}
# the planner in the coordinator's thread, where a test can substitute coord_mod.plan
IN_THREAD = SchedulerConfig(planner_process=False)


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


def test_unowned_devices_are_the_devices_without_an_owner() -> None:
    """The snapshot's cheap set (every plan, twice) matches the per-device list."""
    reg = Registry(ClusterShape(nodes=1, gpus_per_node=8))
    for pid, base in (("A", 0), ("B", 4)):
        reg.register(
            pid,
            {
                "actor_train": ClusterSpec(2, (base, base + 1)),
                "actor_infer": ClusterSpec(1, tuple(range(base, base + 4))),
            },
        )
    reg.pipelines["A"].held["actor_train"] = Priority.ACTOR_TRAINING
    reg.pipelines["B"].active.update({1, 3})
    reg.fence("B", 0, (4,), "sleeping")
    expected = {d for d, o in enumerate(reg.owners()) if o is None}
    assert reg.unowned(set(range(8))) == expected == {2, 3, 4, 6}
    assert reg.unowned({0, 4, 5}) == {4}  # a few devices, as the snapshot asks
    assert reg.snapshot().fenced == [4]


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
        co2.leases.drop_pipeline("A", "test")
        assert await waiting == [0, 1]
        await b.close()
    assert '"ev":"unregister"' in journal.read_text()


async def test_a_pipelines_weight_reaches_the_planner_and_survives_a_restart(
    ipc_ep: str, tmp_path: Path
) -> None:
    """PipelineConfig.weight -> RegisterPipeline -> registry -> snapshot, journaled, so
    a coordinator restarted on its journal divides rollout by the same weights."""
    from rlix_async.control.client import PipelineClient

    journal = tmp_path / "j.jsonl"
    cfg = SchedulerConfig(lease_timeout_s=30)
    co = await Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg).start()
    pc = await PipelineClient.connect(co.endpoint, pipeline_id="A")
    await pc.register({"actor_infer": ClusterSpec(1, (0, 1, 2, 3))}, weight=2.5)
    (snap_pipe,) = co.registry.snapshot().pipelines
    assert snap_pipe.weight == 2.5
    await pc.close()
    await co.close()
    async with Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg) as co2:
        assert co2.registry.pipelines["A"].weight == 2.5
        # a driver resuming with another weight: applied, and journaled for the next restart
        pc = await PipelineClient.connect(co2.endpoint, pipeline_id="A")
        pc.clusters, pc.admitted, pc.weight = (
            {"actor_infer": ClusterSpec(1, (0, 1, 2, 3))},
            True,
            4.0,
        )
        await pc._resume(pc.rpc)
        assert co2.registry.pipelines["A"].weight == 4.0
        await pc.close()
    async with Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg) as co3:
        assert co3.registry.pipelines["A"].weight == 4.0


async def test_planning_runs_off_the_event_loop(ipc_ep: str, monkeypatch) -> None:
    """While a plan is computed (here one that takes 0.8 s) the coordinator answers
    calls at once: the planner runs in its thread, not on the event loop."""
    started = threading.Event()
    real = coord_mod.plan

    def slow(snap):  # type: ignore[no-untyped-def]
        started.set()
        time.sleep(0.8)
        return real(snap)

    async with Coordinator(ipc_ep, SHAPE, config=IN_THREAD) as co:
        a = await joined(co.endpoint, "A")
        monkeypatch.setattr(coord_mod, "plan", slow)
        t0 = time.monotonic()
        co.kick()
        assert await asyncio.to_thread(started.wait, 5)
        reply = await a._call(StatusRequest())  # asked while the plan is made
        assert time.monotonic() - t0 < 0.5, "the call waited for the 0.8 s plan"
        assert isinstance(reply, StatusReply) and reply.devices == 4
        await a.close()


async def test_a_plan_out_of_date_when_made_is_dropped_and_made_again(
    ipc_ep: str, monkeypatch
) -> None:
    """A plan made in the thread on a snapshot the registry has since left (here the
    request it grants was withdrawn meanwhile) is not applied, is not counted as a
    broken plan, and the next step plans on the registry as it is."""
    gate, planning = threading.Event(), threading.Event()
    real = coord_mod.plan

    def gated(snap):  # type: ignore[no-untyped-def]
        if any(r.cluster == "actor_train" for p in snap.pipelines for r in p.requests):
            planning.set()
            gate.wait(5)
        return real(snap)

    async with Coordinator(ipc_ep, SHAPE, config=IN_THREAD) as co:
        a = await joined(co.endpoint, "A")
        monkeypatch.setattr(coord_mod, "plan", gated)
        waiting = asyncio.ensure_future(a.request("actor_train", "ACTOR_TRAINING", timeout=10))
        assert await asyncio.to_thread(planning.wait, 5)
        withdrawn = co.registry.pipelines["A"].requests.pop("actor_train")
        gate.set()
        async with asyncio.timeout(5):
            while co.stale_plans == 0:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert co.rejected_plans == 0
        assert co.registry.pipelines["A"].held == {}
        assert not waiting.done()
        co.registry.pipelines["A"].requests["actor_train"] = withdrawn  # asked again
        co.kick()
        assert await waiting == [0, 1]
        assert co.rejected_plans == 0
        await a.close()


async def test_a_plan_broken_on_its_own_snapshot_is_rejected_in_the_thread_too(
    ipc_ep: str, monkeypatch
) -> None:
    def broken(snap):  # type: ignore[no-untyped-def]
        return Plan(grants=[Grant("A", "actor_train", "ACTOR_TRAINING", [0, 1])])

    async with Coordinator(ipc_ep, SHAPE, config=IN_THREAD) as co:
        a = await joined(co.endpoint, "A")
        monkeypatch.setattr(coord_mod, "plan", broken)
        assert await co._schedule_step() is None
        assert co.rejected_plans == 1 and co.stale_plans == 0
        assert co.registry.pipelines["A"].held == {}
        await a.close()


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
    from rlix_async.protocols import messages as m
    from rlix_async.transport import RpcClient, TransportConfig

    # silent for 1.5 s is dead: short enough for the test, long enough that a loaded
    # CI machine's scheduling stalls (0.26 s seen at a 0.25 s bound) never kill a live one
    fast = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=1.5)
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


async def test_lifted_fences_are_fsynced_together_soon(ipc_ep: str, tmp_path: Path) -> None:
    """An Unfenced line is not fsynced on its own (hundreds a second at scale): one
    fsync covers every fence lifted in the next 50 ms."""
    async with Coordinator(ipc_ep, SHAPE, journal=tmp_path / "journal.jsonl") as co:
        a = await joined(co.endpoint, "A")
        syncs: list[float] = []
        real = co.journal.sync

        def counted() -> None:
            syncs.append(time.monotonic())
            real()

        co.journal.sync = counted  # type: ignore[method-assign]
        for rank in range(4):
            co.registry.fence("A", rank, (rank,), "test")
        co.executor.journal_fences()  # Fenced: lease events, fsynced each
        syncs.clear()
        for rank in range(4):  # confirmed one by one, as acknowledgements arrive
            co.registry.confirm_asleep("A", rank, None)
            co.executor.journal_fences()
        assert syncs == []  # not yet: the lines are written, their fsync is pending
        await asyncio.sleep(0.2)
        assert len(syncs) == 1
        assert (tmp_path / "journal.jsonl").read_text().count('"ev":"unfence"') == 4
        await a.close()


async def test_a_release_replies_only_after_its_event_is_fsynced(ipc_ep, tmp_path: Path) -> None:
    """Group commit: the release acts at once, but its reply is a Deferred answered
    by the next turn's shared fsync, never before the Released event is durable."""
    from rlix_async.protocols import messages as m
    from rlix_async.transport import CallContext, Deferred

    async with Coordinator(ipc_ep, SHAPE, journal=tmp_path / "j.jsonl") as co:
        driver = await joined(co.endpoint, "P")
        try:
            assert await driver.request("actor_train", "ACTOR_TRAINING", timeout=20) == [0, 1]
            ctx = CallContext(m.driver_identity("P"), call_id=1)
            reply = co._release(m.ReleaseStage(pipeline_id="P", cluster="actor_train"), ctx)
            assert "actor_train" not in co.registry.pipelines["P"].held  # acted at once
            assert isinstance(reply, Deferred) and co.journal.unsynced
            durable_at_reply: list[bool] = []
            reply.on_done(lambda ok, exc: durable_at_reply.append(not co.journal.unsynced))
            await asyncio.sleep(0)  # the next turn: the group's fsync, then the reply
            assert durable_at_reply == [True]
            assert '"release"' in (tmp_path / "j.jsonl").read_text()
        finally:
            await driver.close()
