"""Fenced leases with real shard worker processes: a device is never granted while a
worker that held it may still hold it (docs/SCHEDULING.md, "Fenced leases").

Each test runs a real coordinator and real ``rlix-async shard`` processes; their
engine is the scripted test double (tests/helpers/scripted_engine.py: a sleep
that hangs, raises, or never comes back because the process is killed). Pipeline
P trains on device 0 and rolls out on devices 0 and 1, so its training request
shrinks rank 0 and must wait for that shard's sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from helpers.cluster import SCRIPTED_ENGINE, joined_pipeline
from helpers.waits import until

from rlix_async.config import SchedulerConfig
from rlix_async.control.client import PipelineClient
from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols import messages as m
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import TransportConfig

pytestmark = pytest.mark.usefixtures("steady_gc")  # timed heartbeats (conftest)

TOPO = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (0, 1))}
# generous for a loaded 2-core machine: a starved worker must not look lost (1.5 s was
# not: a worker building its engine at first wake beside CI's other worker went silent)
FAST = TransportConfig(heartbeat_interval_s=0.3, heartbeat_timeout_s=3.0)
COMMAND_TIMEOUT_S = 1.0


def spawn_shard(
    endpoint: str, rank: int, devices: list[int] | None = None, *more: str, **engine: object
) -> subprocess.Popen[str]:
    """A shard worker process bound to ``devices`` (default: its rank's), READY or dead."""
    args = {"token_delay_s": 0.01, **engine}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlix_async.cli",
            "shard",
            "pipeline=P",
            f"rank={rank}",
            f"devices={json.dumps(devices if devices is not None else [rank])}",
            f"coordinator={endpoint}",
            "heartbeat_interval_s=0.3",
            "engine.kind=custom",
            f"engine.custom={SCRIPTED_ENGINE}",
            f"engine.custom_args={json.dumps(args)}",
            "engine.sleep_level=1",  # nothing publishes weights here: keep them
            *more,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.startswith("READY"):
        proc.wait(timeout=30)
    return proc


@contextlib.asynccontextmanager
async def cluster(
    ipc_ep: str, **rank0_engine: object
) -> AsyncIterator[tuple[Coordinator, PipelineClient, list[subprocess.Popen[str]]]]:
    """Coordinator, driver of P, two shard workers (rank 0 with the faults), both awake."""
    cfg = SchedulerConfig(command_timeout_s=COMMAND_TIMEOUT_S, lease_timeout_s=60)
    procs: list[subprocess.Popen[str]] = []
    async with Coordinator(ipc_ep, ClusterShape(1, 2), config=cfg, transport=FAST) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO, transport=FAST)
        try:
            procs.append(await asyncio.to_thread(spawn_shard, co.endpoint, 0, **rank0_engine))
            procs.append(await asyncio.to_thread(spawn_shard, co.endpoint, 1))
            await driver.report_progress(64, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=20)
            deadline = time.monotonic() + 20
            while sorted(co.registry.pipelines["P"].active) != [0, 1]:
                assert time.monotonic() < deadline, "both shards never woke"
                await asyncio.sleep(0.05)
            yield co, driver, procs
        finally:
            await _stop(driver, procs)


async def _stop(driver: PipelineClient, procs: list[subprocess.Popen[str]]) -> None:
    await driver.close()
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(timeout=10)


def fenced(co: Coordinator) -> set[int]:
    return {d for f in co.status().fenced for d in f.devices}


async def request_training(driver: PipelineClient) -> tuple[asyncio.Task[list[int]], float]:
    t0 = time.monotonic()
    task = asyncio.ensure_future(driver.request("actor_train", "ACTOR_TRAINING", timeout=60))
    return task, t0


@pytest.mark.timeout(90)
async def test_a_hanging_sleep_keeps_the_device_fenced_until_it_completes(ipc_ep: str) -> None:
    async with cluster(ipc_ep, sleep_delay_s=4.0) as (co, driver, _):
        grant, t0 = await request_training(driver)
        await asyncio.sleep(0.5)
        # the request again, as a client resends one cut by a reconnection: the repeated
        # grant waits for the fence like the first
        again = m.RequestStage(pipeline_id="P", cluster="actor_train", priority="ACTOR_TRAINING")
        await driver.rpc.call(again, timeout=5)
        await asyncio.sleep(2 * COMMAND_TIMEOUT_S)  # the sleep command timed out twice
        assert not grant.done(), "training was granted a device whose shard had not slept"
        assert fenced(co) == {0}
        assert co.registry.owners()[0] is not None  # held by training, not yet delivered
        assert await asyncio.wait_for(grant, 30) == [0]
        assert time.monotonic() - t0 >= 3.5  # only once the shard confirmed its sleep
        assert fenced(co) == set()


@pytest.mark.timeout(90)
async def test_a_failing_sleep_is_retried_and_the_device_granted_only_after_it_succeeds(
    ipc_ep: str,
) -> None:
    async with cluster(ipc_ep, sleep_failures=2) as (co, driver, _):
        grant, t0 = await request_training(driver)
        await asyncio.sleep(0.5)
        assert not grant.done() and fenced(co) == {0}
        [fence] = co.status().fenced
        assert fence.rank == 0 and fence.holder is not None
        assert await asyncio.wait_for(grant, 30) == [0]
        # two failures, each retried after command_timeout_s
        assert time.monotonic() - t0 >= 2 * COMMAND_TIMEOUT_S - 0.2
        assert 0 not in co.registry.pipelines["P"].active  # never woken while fenced


@pytest.mark.timeout(90)
async def test_a_worker_that_vanishes_mid_sleep_stays_fenced_until_replaced(ipc_ep: str) -> None:
    async with cluster(ipc_ep, sleep_delay_s=60.0) as (co, driver, procs):
        grant, _ = await request_training(driver)
        await asyncio.sleep(0.5)
        procs[0].kill()  # mid-sleep; its supervisor has not replaced it yet
        procs[0].wait(timeout=10)
        await asyncio.sleep(FAST.heartbeat_timeout_s + 2.0)  # declared lost, long since
        assert not grant.done(), "a vanished worker's device was granted before it was replaced"
        [fence] = co.status().fenced
        assert fence.devices == [0] and "worker lost" in fence.reason
        # the supervisor reaped it and starts a replacement: its hello proves the old one dead
        procs.append(await asyncio.to_thread(spawn_shard, co.endpoint, 0))
        assert await asyncio.wait_for(grant, 20) == [0]
        assert fenced(co) == set()


@pytest.mark.timeout(60)
async def test_a_shard_bound_to_another_ranks_devices_is_refused(ipc_ep: str) -> None:
    async with Coordinator(ipc_ep, ClusterShape(1, 2), transport=FAST) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO, transport=FAST)
        try:
            proc = await asyncio.to_thread(spawn_shard, co.endpoint, 0, [1])
            assert proc.returncode == 2
            assert proc.stderr is not None
            err = proc.stderr.read()
            assert "bound to devices [1] but rank 0 of P/actor_infer has devices [0]" in err, err
            assert "P/infer/0" not in co.server.peers
        finally:
            await driver.close()


async def test_a_shard_sleeps_before_its_hello_and_reports_memory(ipc_ep: str) -> None:
    from helpers.scripted_engine import ScriptedEngine

    async with Coordinator(ipc_ep, ClusterShape(1, 2)) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO)
        engine = ScriptedEngine()
        assert not engine.asleep  # as a freshly loaded engine is
        worker = await ShardWorker(engine, co.endpoint, "P", 0, devices=[0]).start()
        try:
            assert engine.asleep and engine.sleeps == 1  # before the coordinator heard of it
            await driver.report_progress(8, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=10)
            await until(
                lambda: ("P", 0) in co.executor.shards.memory
            )  # recorded when the ack arrives
            assert co.executor.shards.memory[("P", 0)] > 10 << 20  # this process's RSS, on CPU
        finally:
            await worker.close()
            await driver.close()


@pytest.mark.timeout(60)
async def test_a_misbound_shard_that_joined_before_its_pipeline_is_never_started(
    ipc_ep: str,
) -> None:
    """The launcher starts shards before pipelines register: their devices are checked
    at registration."""
    async with Coordinator(ipc_ep, ClusterShape(1, 2), transport=FAST) as co:
        wrong = await asyncio.to_thread(spawn_shard, co.endpoint, 0, [1])
        right = await asyncio.to_thread(spawn_shard, co.endpoint, 1)
        try:
            assert wrong.poll() is None  # accepted for now: P's topology is unknown
            driver = await joined_pipeline(co.endpoint, "P", TOPO, transport=FAST)
            try:
                assert "P/infer/0" not in co.server.peers
                await driver.report_progress(64, 0, force=True)
                assert await driver.request("actor_infer", "GENERATION", timeout=20) == [1]
                await asyncio.sleep(1.0)
                assert co.registry.pipelines["P"].active == {1}  # rank 0 never started
            finally:
                await driver.close()
        finally:
            for p in (wrong, right):
                p.kill()
                p.wait(timeout=10)


@pytest.mark.timeout(60)
async def test_an_engine_loaded_at_first_wake_holds_nothing_before(
    ipc_ep: str, tmp_path: Path
) -> None:
    """engine.load first_wake (the default on CUDA): a worker that has said hello has not
    built its engine; the coordinator's first wake, on devices it has freed, builds it."""
    marker = tmp_path / "built"
    async with Coordinator(ipc_ep, ClusterShape(1, 2), transport=FAST) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO, transport=FAST)
        proc = await asyncio.to_thread(
            spawn_shard, co.endpoint, 1, None, "engine.load=first_wake", built_marker=str(marker)
        )
        try:
            assert proc.poll() is None and "P/infer/1" in co.server.peers
            await asyncio.sleep(0.5)
            assert not marker.exists()  # connected, asleep, nothing loaded
            await driver.report_progress(8, 0, force=True)
            # (rank 0 has no worker: a pipeline driving its own engine, as far as we know)
            assert 1 in await driver.request("actor_infer", "GENERATION", timeout=20)
            assert marker.exists()
        finally:
            await driver.close()
            proc.kill()
            proc.wait(timeout=10)


class GatedPacer:
    """The coordinator's pacer with a gate the test opens: a realisation step waits
    at ``turn()`` until then, as it would behind a burst of other steps (the real
    TurnPacer's waits cannot be timed from outside)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.waiting = 0

    async def turn(self) -> None:
        self.waiting += 1
        await self.gate.wait()


@pytest.mark.timeout(90)
async def test_a_wake_that_waited_its_turn_is_not_sent_once_its_rank_was_shrunk(
    ipc_ep: str,
) -> None:
    """A wake that waits for its turn of the pacer checks that its rank is still in
    the plan after the wait, not before: a shrink meanwhile must not be followed by
    the stale wake (once the sleep is confirmed and the fence lifted, the shard would
    be awake on devices the plan gives to others)."""
    from rlix_async.protocols.snapshot import Plan, RankChange

    async with cluster(ipc_ep) as (co, _, _procs):
        sent: list[tuple[str, str]] = []
        real_call = co.server.call

        async def spy(ident: str, msg: object, **kw: object) -> object:
            if isinstance(msg, m.ShardCommand):
                sent.append((ident, msg.action))
            return await real_call(ident, msg, **kw)  # type: ignore[arg-type]

        co.server.call = spy  # type: ignore[method-assign]
        gated = GatedPacer()
        co.executor.pacer = gated  # type: ignore[assignment]
        spec = co.registry.pipelines["P"].clusters["actor_infer"]
        wake = asyncio.ensure_future(co.executor._wake_rank("P", 1, spec.bundle(1)))
        await until(lambda: gated.waiting >= 1, timeout=5)
        co.registry.apply(Plan(shrink=[RankChange("P", "actor_infer", [1])]), fence=True)
        gated.gate.set()
        await asyncio.wait_for(wake, 10)
        assert ("P/infer/1", "wake") not in sent


@pytest.mark.timeout(90)
async def test_a_shard_whose_wakes_keep_failing_is_declared_broken_and_its_worker_restarted(
    ipc_ep: str, tmp_path: Path
) -> None:
    """Each failed wake takes the rank out of the plan and the next plan wakes it again:
    without a bound that is a sleep/wake/fail loop for the rest of the run. After
    shard_failures_before_restart (3) in a row the rank stays out, the fence, status and
    journal say why, and the worker exits (3) for its launcher to start a new one, whose
    hello lifts the fence and lets the rank serve again."""
    journal = tmp_path / "journal.jsonl"
    cfg = SchedulerConfig(command_timeout_s=COMMAND_TIMEOUT_S, lease_timeout_s=60)
    async with Coordinator(
        ipc_ep, ClusterShape(1, 2), config=cfg, transport=FAST, journal=journal
    ) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO, transport=FAST)
        procs = [await asyncio.to_thread(spawn_shard, co.endpoint, 0, wake_failures=100)]
        try:
            procs.append(await asyncio.to_thread(spawn_shard, co.endpoint, 1))
            await driver.report_progress(64, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=20)
            assert await asyncio.to_thread(procs[0].wait, 45) == 3  # told to go
            err = procs[0].stderr.read() if procs[0].stderr else ""
            assert "declared it broken: 3 failed syncs or wakes in a row" in err, err
            [fence] = co.status().fenced
            assert fence.rank == 0 and "broken: 3 failed syncs or wakes" in fence.reason, fence
            assert 0 in co.registry.pipelines["P"].offline  # never woken meanwhile
            events = [json.loads(x) for x in journal.read_text().splitlines() if x.strip()]
            reasons = [e.get("reason", "") for e in events if e["ev"] == "fence" and e["rank"] == 0]
            assert any(r.startswith("broken: 3 failed") for r in reasons), reasons
            wakes = sum(1 for e in events if e["ev"] == "expand" and 0 in e.get("ranks", []))
            assert wakes == 3, wakes  # not one more after the third failure
            # the launcher's new worker: its hello lifts the fence, and it serves
            procs.append(await asyncio.to_thread(spawn_shard, co.endpoint, 0))
            await until(lambda: 0 in co.registry.pipelines["P"].active, timeout=30)
            assert fenced(co) == set()
        finally:
            await _stop(driver, procs)
