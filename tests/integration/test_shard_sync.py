"""Selective weight sync driven by the coordinator, with shard workers on real sockets.

Shard workers run the scripted engine (a test double: there is no room for
several vLLM engines on this machine); the weights still travel the real path
(shared-memory cache -> sync -> engine).
"""

from __future__ import annotations

import uuid

from helpers.cluster import joined_pipeline
from helpers.scripted_engine import ScriptedEngine
from helpers.waits import until

from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols.messages import ShardState
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.shards.worker import ShardWorker
from rlix_async.weights.cache import WeightCache

TOPO = {"actor_train": ClusterSpec(1, (0, 1)), "actor_infer": ClusterSpec(1, (0, 1, 2, 3))}


def weights(seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g)}


async def test_wake_syncs_active_stale_shards_sync_sleeping_ones_wait(ipc_ep: str) -> None:
    pid = "A"
    cache = WeightCache(pid, f"ss{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
    async with Coordinator(ipc_ep, ClusterShape(1, 4)) as co:
        driver = await joined_pipeline(co.endpoint, pid, TOPO)
        workers = [
            await ShardWorker(ScriptedEngine(), co.endpoint, pid, r).start() for r in range(4)
        ]
        try:
            cache.build(1, weights(1))
            await driver.publish_weights(cache.promote(1))
            assert all(w.state == ShardState.ASLEEP and w.syncs == 0 for w in workers)

            # wake: every shard the plan expands pulls v1 before serving
            await driver.report_progress(100, 0, force=True)
            ranks = await driver.request("actor_infer", "GENERATION", timeout=10)
            assert ranks == [0, 1, 2, 3]
            await until(lambda: all(w.state == ShardState.ACTIVE for w in workers))
            assert {w.synced_version for w in workers} == {1}
            assert {w.engine.weight_version for w in workers} == {1}
            assert workers[0].engine.loaded_bytes == (256 * 64 + 64) * 4

            # training takes devices 0,1: those shards abort-drain-sleep
            await driver.report_progress(100, 100)
            await driver.request("actor_train", "ACTOR_TRAINING", timeout=10)
            await until(
                lambda: (
                    workers[0].state == ShardState.ASLEEP and workers[1].state == ShardState.ASLEEP
                )
            )
            assert {"abort", "drain", "sleep", "shrink"} <= set(workers[0].phase_ms)

            # v2: only awake, stale shards pull it; sleeping ones are left alone
            cache.build(2, weights(2))
            syncs_before = [w.syncs for w in workers]
            # who is awake is read before the publish: after it, a shard may already
            # be SYNCING (the coordinator's sync can arrive before publish returns)
            awake = [w for w in workers if w.state == ShardState.ACTIVE]
            asleep = [w for w in workers if w.state == ShardState.ASLEEP]
            assert awake and len(awake) + len(asleep) == len(workers)
            await driver.publish_weights(cache.promote(2))
            await until(lambda: all(w.synced_version == 2 for w in awake))
            assert all(w.syncs == syncs_before[w.rank] for w in asleep)

            # training done, rollout again: woken shards catch up to v2 on wake
            await driver.release("actor_train")
            await driver.report_progress(100, 0, force=True)
            await until(lambda: all(w.state == ShardState.ACTIVE for w in workers))
            await until(lambda: all(w.synced_version == 2 for w in workers))
            await until(
                lambda: co.executor.shards.versions.get((pid, 0)) == 2
            )  # once the ack is in
        finally:
            for w in workers:
                await w.close()
            await driver.close()
            cache.close()
