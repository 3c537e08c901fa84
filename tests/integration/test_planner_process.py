"""The planner in its own process (control/planner_proc.py): same plans as the
function, restarted when killed, errors reported; and a coordinator using it."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import msgspec
import pytest
from helpers.cluster import joined_pipeline

from rlix_async.bench.snapshots import random_snapshot
from rlix_async.control.coordinator import Coordinator
from rlix_async.control.planner import plan
from rlix_async.control.planner_proc import PlannerError, PlannerProcess, PlannerTimeout
from rlix_async.protocols.snapshot import PipelineIn, RequestIn, Snapshot
from rlix_async.protocols.topology import ClusterShape, ClusterSpec


def test_same_plans_as_the_function_restarted_when_killed_errors_reported() -> None:
    proc = PlannerProcess()
    proc.start()
    try:
        rng = random.Random(0)
        for _ in range(5):
            snap = random_snapshot(rng, 256, 16)
            assert msgspec.json.encode(proc.plan(snap)) == msgspec.json.encode(plan(snap))
        first = proc.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        snap = random_snapshot(rng, 64, 4)
        assert msgspec.json.encode(proc.plan(snap)) == msgspec.json.encode(plan(snap))
        assert proc.restarts == 1 and proc.pid != first
        # a planner that raises (here: a pipeline without actor_infer, which the
        # registry never lets in) is an error with its reason, not a dead process
        bad = Snapshot(
            cluster=ClusterShape(1, 2),
            pipelines=[
                PipelineIn(
                    id="a",
                    clusters={"actor_train": ClusterSpec(1, (0, 1))},
                    active_ranks={"actor_infer": [0]},
                    requests=[RequestIn(seq=1, cluster="actor_train", priority="ACTOR_TRAINING")],
                )
            ],
        )
        with pytest.raises(PlannerError, match="KeyError"):
            proc.plan(bad)
        assert proc.restarts == 1
    finally:
        proc.close()
    assert proc.pid is None


def test_a_hung_planner_is_killed_and_replaced_within_its_timeout() -> None:
    proc = PlannerProcess(timeout_s=0.5)
    proc.start()
    try:
        hung = proc.pid
        assert hung is not None
        os.kill(hung, signal.SIGSTOP)  # alive, never answers, never reads
        # 4,096 devices: ~90 KB, more than a pipe holds, so the write itself must
        # give up at the deadline too
        snap = random_snapshot(random.Random(1), 4096, 256)
        t0 = time.monotonic()
        with pytest.raises(
            PlannerTimeout, match=r"(took no snapshot|did not answer) in 0\.5 s; restarted"
        ):
            proc.plan(snap)
        assert time.monotonic() - t0 < 3
        assert proc.restarts == 1 and proc.pid != hung
        with pytest.raises(ProcessLookupError):
            os.kill(hung, 0)  # killed and reaped
        assert msgspec.json.encode(proc.plan(snap)) == msgspec.json.encode(plan(snap))
    finally:
        proc.close()


def test_close_does_not_wait_for_a_hung_plan() -> None:
    """Closing (the coordinator stopping) while a plan waits on a hung child ends
    both at once, not after the 60 s timeout, and starts no new child."""
    proc = PlannerProcess()
    proc.start()
    hung = proc.pid
    assert hung is not None
    os.kill(hung, signal.SIGSTOP)
    outcome: list[BaseException] = []

    def ask() -> None:
        try:
            proc.plan(random_snapshot(random.Random(2), 64, 4))
        except BaseException as exc:
            outcome.append(exc)

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.3)  # the plan is waiting
    t0 = time.monotonic()
    proc.close()
    asker.join(5)
    assert time.monotonic() - t0 < 3
    assert len(outcome) == 1 and isinstance(outcome[0], PlannerError)
    assert proc.pid is None and proc.restarts == 0
    with pytest.raises(ProcessLookupError):
        os.kill(hung, 0)


async def test_a_coordinator_plans_in_its_process_and_survives_its_death(ipc_ep: str) -> None:
    shape = ClusterShape(nodes=1, gpus_per_node=4)
    topo = {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))}
    async with Coordinator(ipc_ep, shape) as co:
        assert co.planner_process is not None
        child = co.planner_process.pid
        assert child is not None
        a = await joined_pipeline(co.endpoint, "A", topo)
        assert await a.request("actor_train", "ACTOR_TRAINING", timeout=10) == [0, 1]
        os.kill(child, signal.SIGKILL)
        await a.release("actor_train")
        b = await joined_pipeline(co.endpoint, "B", topo)
        assert await b.request("actor_train", "ACTOR_TRAINING", timeout=10) == [0, 1]
        assert co.planner_process.restarts >= 1
        replacement = co.planner_process.pid
        await a.close()
        await b.close()
    for pid in (child, replacement):  # reaped, not left behind (nor as zombies)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
