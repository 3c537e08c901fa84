"""examples/own_training_loop.py joins a real coordinator and trains through the four hooks.

Shard workers run the scripted engine (a test double: the fast tier cannot
start vLLM; its tokens are deterministic, so only the plumbing is checked): the
weights the shards served each step, as the router reported them, are the
previous step's (the example asks for them with ``min_version``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest
from helpers.scripted_engine import ScriptedEngine

from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols.topology import ClusterShape
from rlix_async.shards.router import Trajectory
from rlix_async.shards.worker import ShardWorker

EXAMPLE = Path(__file__).parents[2] / "examples" / "own_training_loop.py"


async def test_own_training_loop_example_runs_against_a_coordinator(ipc_ep: str) -> None:
    async with Coordinator(ipc_ep, ClusterShape(1, 2)) as co:
        workers = [
            await ShardWorker(
                ScriptedEngine(token_delay_s=0.001, vocab=512), co.endpoint, "my-experiment", r
            ).start()
            for r in range(2)
        ]
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                str(EXAMPLE),
                "--coordinator",
                co.endpoint,
                "--steps",
                "2",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await asyncio.wait_for(proc.communicate(), 100)
            assert proc.returncode == 0, err.decode()[-3000:]
            lines = out.decode().splitlines()
            assert [line.split(":")[0] for line in lines] == ["step 1", "step 2"]
            # on-policy: each step trained on tokens of the weights the step before made
            assert [line.split("versions ")[1] for line in lines] == ["[0]", "[1]"]
            assert all(w.syncs >= 1 for w in workers)  # the new weights reached the shards
            assert "my-experiment" not in co.registry.pipelines  # it unregistered
        finally:
            for w in workers:
                await w.close()


def test_the_example_trains_on_the_versions_the_router_reports() -> None:
    spec = importlib.util.spec_from_file_location("own_training_loop", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    cut = Trajectory([1], [5, 6, 7], [-1.0] * 3, [3, 3, 4], resumes=1)  # resumed on newer weights
    assert example.token_versions(cut) == [3, 3, 4]
    with pytest.raises(RuntimeError, match="without a weight version"):
        example.token_versions(Trajectory([1], [5], [-1.0], [None]))
