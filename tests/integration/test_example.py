"""examples/own_training_loop.py joins a real coordinator and trains through the four hooks.

Shard workers run the scripted engine (a test double: the fast tier cannot
start vLLM; its tokens are deterministic, so only the plumbing is checked).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from helpers.scripted_engine import ScriptedEngine

from rlix_async.control.coordinator import Coordinator
from rlix_async.control.topology import ClusterShape
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
            assert all(w.syncs >= 1 for w in workers)  # the new weights reached the shards
            assert "my-experiment" not in co.registry.pipelines  # it unregistered
        finally:
            for w in workers:
                await w.close()
