"""A pipeline driver with logical rollout shards, for control-plane integration tests.

It runs the RLix cycle through the real client library and coordinator:
rollout (GENERATION, progress reported in 2% buckets; speed proportional to the
awake ranks) -> ACTOR_TRAINING on its train devices -> release. There is no
engine: the ranks it is given are counted, not used (the shard and GRPO issues
put real engines behind them).

    python tests/helpers/pipeline_driver.py ENDPOINT --id A --train 0,1 --infer 0-7 --steps 5
Prints ``STEP i`` after each step and ``DONE`` at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout

from rlix_async.aio import run
from rlix_async.control.client import PipelineClient
from rlix_async.protocols.topology import ClusterSpec
from rlix_async.transport import TransportConfig


def devices(text: str) -> tuple[int, ...]:
    if "-" in text:
        a, b = text.split("-")
        return tuple(range(int(a), int(b) + 1))
    return tuple(int(x) for x in text.split(","))


async def main(args: argparse.Namespace) -> None:
    transport = TransportConfig(
        heartbeat_interval_s=args.hb, heartbeat_timeout_s=2.5 * args.hb, connect_timeout_s=60
    )
    pc = await PipelineClient.connect(args.endpoint, pipeline_id=args.id, transport=transport)
    await pc.register(
        {
            "actor_train": ClusterSpec(1, devices(args.train)),
            "actor_infer": ClusterSpec(1, devices(args.infer)),
        }
    )
    await pc.admit()
    for step in range(args.steps):
        await pc.report_progress(args.target, 0, force=True)
        await pc.request("actor_infer", "GENERATION", args.target, timeout=120)
        done = 0
        while done < args.target:
            await asyncio.sleep(args.tick)
            done = min(args.target, done + len(pc.active_ranks))
            await pc.report_progress(args.target, done)
        await pc.request("actor_train", "ACTOR_TRAINING", timeout=120)
        await asyncio.sleep(args.train_s)
        await pc.release("actor_train")
        print(f"STEP {step}", flush=True)
    await pc.unregister()
    await pc.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("--id", required=True)
    p.add_argument("--train", required=True)
    p.add_argument("--infer", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--target", type=int, default=40)
    p.add_argument("--tick", type=float, default=0.02)
    p.add_argument("--train-s", type=float, default=0.2)
    p.add_argument("--hb", type=float, default=0.2)
    run(main(p.parse_args()))
