"""Supervision and reaping: a coordinator that cannot schedule stops (to be restarted),
a restart loop backs off and gives up, ranks nobody serves are fenced, and what a
dropped pipeline left behind is reaped. Real coordinators, sockets, files and
processes."""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
from pathlib import Path

import pytest
from helpers.cluster import joined_pipeline

from rlix_async.config import LaunchConfig, SchedulerConfig, convert
from rlix_async.control import journal as ev
from rlix_async.control.coordinator import Coordinator
from rlix_async.control.journal import Journal
from rlix_async.protocol import RpcError
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.transport import RpcClient

SHAPE = ClusterShape(nodes=1, gpus_per_node=4)
TOPO = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (1, 2))}
FAST = SchedulerConfig(lease_timeout_s=0.6)


async def test_a_dead_lease_loop_makes_the_coordinator_fatal(ipc_ep: str) -> None:
    """The lease loop dying (here: its journal compaction raises) is not logged and
    forgotten: the coordinator's ``fatal`` is set, which ``serve`` turns into exit 1."""
    async with Coordinator(ipc_ep, SHAPE, config=FAST) as co:
        assert co.fatal is not None and not co.fatal.done()

        def broken(*args: object) -> bool:
            raise RuntimeError("disk gone")

        co.journal.maybe_compact = broken  # type: ignore[method-assign]
        async with asyncio.timeout(5):
            reason = await co.fatal
        assert "leases died: RuntimeError: disk gone" in reason


async def test_a_failed_journal_write_aborts_the_plan(ipc_ep: str, tmp_path: Path) -> None:
    """A plan whose events cannot be written is not carried out (the grant never goes
    out) and the coordinator turns fatal, to be rebuilt from what was written. The
    journal fails for real: /dev/full answers every write with ENOSPC."""
    cfg = SchedulerConfig(plan_interval_s=1.5, rebalance_s=60)
    async with Coordinator(ipc_ep, SHAPE, journal=tmp_path / "j.jsonl", config=cfg) as co:
        a = await joined_pipeline(co.endpoint, "a", TOPO)  # planned; the next plan waits 1.5 s
        grant = asyncio.ensure_future(a.request("actor_train", "ACTOR_TRAINING", timeout=4))
        async with asyncio.timeout(1):  # the request is recorded (the journal still works)
            while "actor_train" not in co.registry.pipelines["a"].requests:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        assert co.plans == 0
        co.journal.close()
        co.journal = Journal("/dev/full")
        co.journal.on_error = co._journal_failed
        with pytest.raises(TimeoutError):  # the plan's Granted could not be written
            await grant
        assert co.fatal is not None
        async with asyncio.timeout(10):  # (a loaded host may plan after the grant's 4 s)
            reason = await co.fatal
        assert "journal write failed" in reason
        assert co.plans == 0  # nothing was realised
        await a.close()


async def test_a_failed_fsync_of_a_plan_is_fatal_too(
    ipc_ep: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's events were written but could not be made durable (EIO from fsync,
    the disk failing): not carried out, and the coordinator turns fatal."""
    async with Coordinator(ipc_ep, SHAPE, journal=tmp_path / "j.jsonl") as co:
        a = await joined_pipeline(co.endpoint, "a", TOPO)

        def failing_fsync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(TimeoutError):
            await a.request("actor_train", "ACTOR_TRAINING", timeout=1.5)
        assert co.fatal is not None and co.fatal.done()
        assert "fsync failed" in co.fatal.result()
        assert co.plans == 0
        monkeypatch.undo()
        await a.close()


async def test_a_failed_write_in_a_handler_refuses_the_call(ipc_ep: str, tmp_path: Path) -> None:
    async with Coordinator(ipc_ep, SHAPE, journal=tmp_path / "j.jsonl") as co:
        a = await joined_pipeline(co.endpoint, "a", TOPO)
        co.journal.close()
        co.journal = Journal("/dev/full")
        co.journal.on_error = co._journal_failed
        with pytest.raises(RpcError, match="No space left on device"):
            await a.request("actor_train", "ACTOR_TRAINING", timeout=3)
        assert co.fatal is not None and "journal write failed" in co.fatal.result()
        await a.close()


def test_a_coordinator_that_keeps_dying_is_restarted_with_backoff_then_given_up(
    tmp_path: Path,
) -> None:
    from rlix_async.launch import Launcher, Proc

    cfg = convert(
        {
            "out": str(tmp_path / "out"),
            "cluster": {"nodes": 1, "gpus_per_node": 2},
            "pipelines": [
                {
                    "id": "p",
                    "clusters": {
                        "actor_train": {"devices": [0]},
                        "actor_infer": {"devices": [1]},
                    },
                }
            ],
        },
        LaunchConfig,
        "test",
    )
    launcher = Launcher(cfg)
    launcher.logs.mkdir(parents=True)
    launcher.max_coordinator_restarts = 3
    launcher.coordinator = Proc(
        "coordinator", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "c.log"
    )
    launcher.coordinator.start(launcher.env)
    starts: list[float] = []
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"keeps failing \(exit 3, 4 times"):
        while time.monotonic() - t0 < 30:
            before = launcher.coordinator.restarts
            launcher.step()
            if launcher.coordinator.restarts > before:
                starts.append(time.monotonic())
            time.sleep(0.05)
    assert len(starts) == 3
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    assert gaps[0] >= 0.5 and gaps[1] >= 1.0  # growing pauses, not a spin


async def test_an_awake_rank_whose_worker_never_returns_is_fenced(
    ipc_ep: str, tmp_path: Path
) -> None:
    """After a restart the journal says rank 0 is awake and had a worker; the driver
    comes back but the worker does not: past lease_timeout_s the rank leaves the plan,
    fenced (its devices may still hold a live engine's memory)."""
    journal = tmp_path / "j.jsonl"
    ev.write_journal(
        journal,
        [
            ev.Registered(pipeline="a", clusters=TOPO),
            ev.Admitted(pipeline="a"),
            ev.ShardJoined(pipeline="a", rank=0, incarnation="host:1"),
            ev.Expanded(pipeline="a", cluster="actor_infer", ranks=[0], devices=[1]),
        ],
    )
    async with Coordinator(ipc_ep, SHAPE, journal=journal, config=FAST) as co:
        assert co.registry.pipelines["a"].active == {0}
        a = await joined_pipeline(co.endpoint, "a", TOPO)  # the driver is back
        async with asyncio.timeout(5):
            while 0 in co.registry.pipelines["a"].active:  # noqa: ASYNC110  (polls state)
                await asyncio.sleep(0.05)
        fence = co.registry.fences[("a", 0)]
        assert "worker never returned" in fence.reason and fence.devices == (1,)
        assert "a" in co.registry.pipelines  # the pipeline itself carries on
        await a.close()


async def test_a_dropped_pipeline_leaves_nothing_behind(ipc_ep: str) -> None:
    async with Coordinator(ipc_ep, SHAPE, config=FAST) as co:
        a = await joined_pipeline(co.endpoint, "a", TOPO)
        worker = RpcClient(
            co.endpoint, "a/infer/0", info={"data_endpoint": "ipc:///x", "data_key": "k"}
        )
        await worker.connect()
        assert co.executor.shards.endpoints and co.executor.shards.data_keys
        await a.unregister()
        assert not co.executor.shards.versions and not co.executor.shards.weights
        # its worker is still connected and says hello only once: a returning pipeline
        # (a trainer resumed elsewhere) must still find its data plane
        assert co.executor.shards.endpoints == {("a", 0): "ipc:///x"}
        assert co.executor.shards.data_keys == {("a", 0): "k"}
        await worker.close()
        async with asyncio.timeout(5):
            while co.executor.shards.endpoints or co.executor.shards.data_keys:  # noqa: ASYNC110 (polls state)
                await asyncio.sleep(0.05)
        await a.close()
        # an id handed out but never registered is reaped after lease_timeout_s
        async with RpcClient(co.endpoint, "admin-1/cli/0") as cli:
            from rlix_async.protocols import messages as m

            reply = await cli.call(m.AllocatePipelineId(kind="ft"))
            assert isinstance(reply, m.PipelineIdReply)
            assert reply.pipeline_id in co.registry.pipelines
        async with asyncio.timeout(5):
            while reply.pipeline_id in co.registry.pipelines:  # noqa: ASYNC110
                await asyncio.sleep(0.05)


async def test_kicks_coalesce_into_few_plans(ipc_ep: str) -> None:
    """Events arriving faster than plan_interval_s are planned together."""
    cfg = SchedulerConfig(plan_interval_s=0.2, rebalance_s=60)
    async with Coordinator(ipc_ep, SHAPE, config=cfg) as co:
        calls = 0
        real = co._schedule_step

        async def counted():  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            return await real()

        co._schedule_step = counted  # type: ignore[method-assign]
        t0 = time.monotonic()
        for _ in range(100):
            co.kick()
            await asyncio.sleep(0.005)
        elapsed = time.monotonic() - t0
        await asyncio.sleep(0.3)
        # at most one plan per interval (+1 for the first and the trailing one)
        assert 1 <= calls <= elapsed / 0.2 + 2, (calls, elapsed)


async def test_progress_alone_replans_at_most_every_progress_interval(ipc_ep: str) -> None:
    """Progress reports (hundreds a second at scale) wait for ``progress_interval_s``;
    an urgent kick behind them is planned at once. The same PlanCadence paces the
    simulator, so what it measures is what the coordinator does."""
    cfg = SchedulerConfig(
        plan_interval_s=0.0, progress_interval_s=0.5, rebalance_s=60, planner_process=False
    )
    async with Coordinator(ipc_ep, SHAPE, config=cfg) as co:
        starts: list[float] = []
        real = co._schedule_step

        async def counted():  # type: ignore[no-untyped-def]
            starts.append(time.monotonic())
            return await real()

        co._schedule_step = counted  # type: ignore[method-assign]
        await asyncio.sleep(0.1)  # the first (timer) plan
        starts.clear()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.6:
            co.kick(progress=True)
            await asyncio.sleep(0.01)
        assert 2 <= len(starts) <= 4, starts  # ~every 0.5 s, not 160 plans
        gaps = [b - a for a, b in itertools.pairwise(starts)]
        assert all(g >= 0.45 for g in gaps), gaps
        before, kicked = len(starts), time.monotonic()
        co.kick(progress=True)
        co.kick()  # urgent: not held back by the pending progress (due 0.5 s after)
        while len(starts) == before and time.monotonic() - kicked < 0.4:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        assert len(starts) == before + 1


async def test_a_report_that_starts_demand_is_planned_at_once(ipc_ep: str) -> None:
    """A driver asks for shards by reporting a batch to fill, after its registration
    (or its release after a step) was already planned: that report is urgent, not
    progress to be batched for ``progress_interval_s`` (here 5 s)."""
    cfg = SchedulerConfig(progress_interval_s=5.0, rebalance_s=60, planner_process=False)
    async with Coordinator(ipc_ep, SHAPE, config=cfg) as co:
        a = await joined_pipeline(co.endpoint, "a", {"actor_infer": ClusterSpec(1, (0, 1))})
        await asyncio.sleep(0.2)  # its registration planned (nothing to give yet)
        t0 = time.monotonic()
        await a.report_progress(32, 0, force=True)
        while not co.registry.pipelines["a"].active:
            assert time.monotonic() - t0 < 2.0, "the demand waited for the progress interval"
            await asyncio.sleep(0.01)
        await a.close()
