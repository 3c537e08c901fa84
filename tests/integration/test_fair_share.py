"""Finish-time fairness through a running coordinator, over real ipc sockets: pace
reports and training releases reach the planner, and rollout devices follow them."""

from __future__ import annotations

import asyncio
from pathlib import Path

from helpers.cluster import joined_pipeline
from rich.console import Console

from rlix_async.config import SchedulerConfig
from rlix_async.control.client import PipelineClient
from rlix_async.control.coordinator import Coordinator
from rlix_async.observe.status import render
from rlix_async.protocols.snapshot import Policy
from rlix_async.protocols.topology import ClusterShape, ClusterSpec

SHAPE = ClusterShape(nodes=1, gpus_per_node=4)
TOPO = {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))}


async def _settled(a: PipelineClient, b: PipelineClient, want: tuple[int, int]) -> tuple[int, int]:
    got = (0, 0)
    for _ in range(100):
        got = (len(a.active_ranks), len(b.active_ranks))
        if got == want:
            break
        await asyncio.sleep(0.05)
    return got


async def test_the_pipeline_slowed_most_gets_the_rollout_devices(ipc_ep: str) -> None:
    """A and B each train a step; A reports a step alone of 0.05 s (read as its 0.2 s
    training hold, which the coordinator timed) and B one of 1000 s: A is slowed far
    more and gets three of the four rollout devices, B the one left while bundles
    remain for both; status shows each slowdown. Under fairness: demand the same
    reports split them 2/2."""
    for policy, want in (("finish_time", (3, 1)), ("demand", (2, 2))):
        config = SchedulerConfig(policy=Policy(fairness=policy))  # type: ignore[arg-type]
        async with Coordinator(ipc_ep, SHAPE, config=config) as co:
            a = await joined_pipeline(co.endpoint, "A", TOPO)
            b = await joined_pipeline(co.endpoint, "B", TOPO)
            for c in (a, b):  # a step each, as the coordinator sees it
                assert await c.request("actor_train", "ACTOR_TRAINING", timeout=5) == [0, 1]
                await asyncio.sleep(0.2)
                await c.release("actor_train")
            await a.report_pace(0.05)
            await b.report_pace(1000.0)
            for c in (a, b):
                await c.report_progress(100, 0, force=True)
                await c.request("actor_infer", "GENERATION", timeout=5)
            assert await _settled(a, b, want) == want, policy
            status = {p.id: p for p in co.status().pipelines}
            # (how slowed, in seconds of this test, depends on the machine's load)
            assert status["A"].slowdown is not None and status["A"].slowdown > 1
            assert status["B"].slowdown is not None
            assert status["B"].slowdown < status["A"].slowdown / 100
            console = Console(record=True, width=160)
            console.print(render(co.status()))
            assert "x its pace alone" in console.export_text()
            await a.close()
            await b.close()


async def test_a_pace_comes_back_with_its_driver_after_a_restart(
    ipc_ep: str, tmp_path: Path
) -> None:
    """Paces are advisory and not journaled: a coordinator restarted on its journal
    knows none until the driver resumes, which re-sends its last estimate; the
    slowdown is read again once a step has ended since."""
    journal = tmp_path / "j.jsonl"
    cfg = SchedulerConfig(lease_timeout_s=30)
    co = await Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg).start()
    a = await joined_pipeline(co.endpoint, "A", TOPO)
    await a.report_pace(7.5)
    await asyncio.sleep(0.1)
    assert co.registry.pace._pace["A"].exclusive_s == 7.5
    await a.close()
    await co.close()
    async with Coordinator(ipc_ep, SHAPE, journal=journal, config=cfg) as co2:
        known = co2.registry.pace._pace.get("A")  # the journal gave no estimate back
        assert known is None or known.exclusive_s is None
        pc = await PipelineClient.connect(co2.endpoint, pipeline_id="A")
        pc.clusters, pc.admitted, pc._pace = dict(TOPO), True, 7.5  # what A's client held
        await pc._resume(pc.rpc)
        await asyncio.sleep(0.1)
        assert co2.registry.pace._pace["A"].exclusive_s == 7.5
        assert await pc.request("actor_train", "ACTOR_TRAINING", timeout=5) == [0, 1]
        await pc.release("actor_train")
        slowdown = co2.status().pipelines[0].slowdown
        assert slowdown is not None and slowdown > 0
        # the training the coordinator timed ran from the grant's delivery to the release
        assert 0 < co2.registry.pace._pace["A"].training_s < 5
        await pc.close()
