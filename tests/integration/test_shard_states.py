"""Shard states that cannot lie: a shard never serves weights it does not hold and never
sleeps under running requests.

Real coordinator, real sockets, real shared-memory weight cache; the engine is the
scripted test double (tests/helpers/scripted_engine.py), in process.
"""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import msgspec
import pytest
import torch
from helpers.cluster import joined_pipeline
from helpers.scripted_engine import ScriptedEngine
from helpers.waits import until

from rlix_async.control.coordinator import Coordinator
from rlix_async.protocol import RpcError
from rlix_async.protocols.generation import Generate, GenerateResult, Sampling, ShardRefusal
from rlix_async.protocols.messages import ShardState
from rlix_async.protocols.sinks import SyncError
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import RpcClient
from rlix_async.weights.cache import WeightCache

TOPO = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (0,))}


async def generate(client: RpcClient, rid: str, max_tokens: int = 4) -> GenerateResult:
    reply = await client.call(
        Generate(request_id=rid, prompt_ids=[1, 2], sampling=Sampling(max_tokens=max_tokens)),
        timeout=30,
    )
    assert isinstance(reply, GenerateResult)
    return reply


async def test_a_shard_woken_without_weights_refuses_until_a_sync_brings_them(
    ipc_ep: str,
) -> None:
    """Level-2 sleep discards the weights; woken with nothing published (as after a
    coordinator restart, before the driver re-publishes), the shard must not serve."""
    cache = WeightCache("P", f"st{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO)
        worker = await ShardWorker(ScriptedEngine(), co.endpoint, "P", 0, sleep_level=2).start()
        client = await RpcClient(worker.data.endpoint, "P/router/0").connect()
        try:
            await driver.report_progress(8, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=10)
            assert worker.state == ShardState.WAKING  # awake, holding no weights
            with pytest.raises(RpcError) as refused:
                await generate(client, "r0")
            assert refused.value.code == ShardRefusal.PREEMPTED  # not serving: try elsewhere
            assert "WAKING" in refused.value.detail

            cache.build(0, {"w": torch.ones(64, 64)})
            await driver.publish_weights(cache.promote(0))  # the coordinator syncs it
            await until(lambda: worker.state == ShardState.ACTIVE)
            assert worker.synced_version == 0
            assert len((await generate(client, "r1")).token_ids) == 4
        finally:
            await client.close()
            await worker.close()
            await driver.close()
            cache.close()


async def test_past_the_drain_timeout_running_requests_are_cut_before_the_sleep(
    ipc_ep: str,
) -> None:
    engine = ScriptedEngine(token_delay_s=0.02, ignore_abort=True)  # aborts are lost
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO)
        worker = await ShardWorker(
            engine, co.endpoint, "P", 0, sleep_level=1, drain_timeout_s=0.3
        ).start()
        client = await RpcClient(worker.data.endpoint, "P/router/0").connect()
        try:
            await driver.report_progress(8, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=10)
            job = asyncio.ensure_future(generate(client, "long", max_tokens=500))
            await until(lambda: engine.num_running() == 1)
            await asyncio.sleep(0.2)  # some tokens decoded
            await worker.shrink()
            assert worker.state == ShardState.ASLEEP
            assert engine.running_at_sleep[-1] == 0  # nothing ran under the sleep
            result = await asyncio.wait_for(job, 10)
            assert result.preempted and 0 < len(result.token_ids) < 500  # answered, not lost
        finally:
            await client.close()
            await worker.close()
            await driver.close()


async def test_a_response_that_ends_at_its_stop_token_during_a_shrink_is_finished(
    ipc_ep: str,
) -> None:
    """A request that reaches its end of sequence while the shard drains ended on its own:
    answered as finished, never as cut (resumed, it would be continued past its end)."""
    # the request goes on through the pause and abort, and ends at its stop token
    engine = ScriptedEngine(token_delay_s=0.03, ignore_abort=True, ignore_pause=True)
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO)
        worker = await ShardWorker(
            engine, co.endpoint, "P", 0, sleep_level=1, drain_timeout_s=5.0
        ).start()
        client = await RpcClient(worker.data.endpoint, "P/router/0").connect()
        try:
            await driver.report_progress(8, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=10)
            # tokens 3, 4, 5, ...: the stop token 15 is the 13th
            msg = Generate(
                request_id="eos",
                prompt_ids=[1, 2],
                sampling=Sampling(max_tokens=500, stop_token_ids=(15,)),
            )
            job = asyncio.ensure_future(client.call(msg, timeout=30))
            await until(lambda: engine.num_running() == 1)
            await worker.shrink()  # marks the shard preempted, then waits for the drain
            result = await asyncio.wait_for(job, 10)
            assert isinstance(result, GenerateResult)
            assert result.token_ids[-1] == 15 and len(result.token_ids) == 13
            assert not result.preempted
        finally:
            await client.close()
            await worker.close()
            await driver.close()


async def test_a_shard_whose_requests_cannot_be_stopped_does_not_sleep(ipc_ep: str) -> None:
    engine = ScriptedEngine(stuck=1)  # one request the engine counts and never ends
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO)
        worker = await ShardWorker(
            engine, co.endpoint, "P", 0, sleep_level=1, drain_timeout_s=0.2
        ).start()
        try:
            await driver.report_progress(8, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=10)
            sleeps = engine.sleeps
            with pytest.raises(RuntimeError, match="still running after abort"):
                await worker.shrink()
            assert engine.sleeps == sleeps  # the sleep was refused, the engine not slept
            assert worker.state == ShardState.DRAINING and worker.preempted
        finally:
            await worker.close()
            await driver.close()


async def test_a_sync_that_fails_midway_takes_the_shard_out_of_service(ipc_ep: str) -> None:
    """Refused before any weight changed: the old version serves on. Failed after the
    load began: the weights are unknown, so the shard serves nothing."""
    cache = WeightCache("P", f"st{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
    engine = ScriptedEngine()
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO)
        worker = await ShardWorker(engine, co.endpoint, "P", 0).start()
        client = await RpcClient(worker.data.endpoint, "P/router/0").connect()
        try:
            cache.build(0, {"w": torch.ones(64, 64)})
            await driver.publish_weights(cache.promote(0))
            await driver.report_progress(8, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=10)
            await until(lambda: worker.state == ShardState.ACTIVE)

            cache.build(1, {"w": torch.zeros(64, 64)})
            engine.load_error = "refused"
            with pytest.raises(Exception, match="scripted refusal"):
                await worker.sync(cache.promote(1))
            assert worker.state == ShardState.ACTIVE and worker.synced_version == 0
            assert len((await generate(client, "r0")).token_ids) == 4

            engine.load_error = "midway"
            with pytest.raises(RuntimeError, match="mid-load"):
                await worker.sync(cache.ref(1))
            assert worker.state == ShardState.WAKING and not worker.weights_valid
            with pytest.raises(RpcError):
                await generate(client, "r1")
        finally:
            await client.close()
            await worker.close()
            await driver.close()
            cache.close()


async def test_a_hung_sleep_makes_the_worker_exit_to_be_replaced(ipc_ep: str) -> None:
    """Past sleep_timeout_s the worker gives up (serve() then exits 3 and the launcher
    replaces it; the replacement's hello lifts the fence)."""
    engine = ScriptedEngine(sleep_delay_s=30.0)
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO)
        worker = await ShardWorker(
            engine, co.endpoint, "P", 0, sleep_level=1, sleep_timeout_s=0.5
        ).start()
        try:
            await driver.report_progress(8, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=10)
            with pytest.raises(TimeoutError):
                await worker.shrink()
            assert worker.engine_dead.is_set() and worker.state != ShardState.ASLEEP
        finally:
            await worker.close()
            await driver.close()


async def test_a_shard_loads_only_its_own_pipelines_weights(ipc_ep: str) -> None:
    """Whoever sends the command, a shard of P refuses a version of Q before its
    engine is touched, and keeps serving the version it had."""
    cache = WeightCache("P", f"st{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
    engine = ScriptedEngine()
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        worker = await ShardWorker(engine, co.endpoint, "P", 0, sleep_level=2).start()
        try:
            cache.build(0, {"w": torch.ones(64, 64)})
            ref = cache.promote(0)
            await worker.wake(ref)
            assert worker.synced_version == 0
            cache.build(1, {"w": torch.zeros(64, 64)})
            theirs = msgspec.structs.replace(cache.promote(1), pipeline="Q")
            with pytest.raises(SyncError, match="shard of P refuses weights of Q"):
                await worker._load(theirs)
            assert worker.synced_version == 0 and engine.weight_version == 0
        finally:
            await worker.close()
            cache.close()


# --- the worker's shrink/wake paths against vLLM's per-tag sleep semantics -------------
# (tests/helpers/shard_cycles.py; the GPU tier runs the same sequences on real vLLM)


async def test_wake_without_weights_then_shrink_holds_what_vllm_would(ipc_ep: str) -> None:
    from helpers.shard_cycles import wake_without_weights_then_shrink

    cache = WeightCache("P", f"st{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
    engine = ScriptedEngine(weights_bytes=10, kv_bytes=100)
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        worker = await ShardWorker(engine, co.endpoint, "P", 0, sleep_level=2).start()
        try:
            seen = await wake_without_weights_then_shrink(
                worker, cache, {"w": torch.ones(64, 64)}, 0
            )
        finally:
            await worker.close()
            cache.close()
    states = [(s.step, s.state, s.weights_valid) for s in seen]
    assert states == [
        ("asleep", ShardState.ASLEEP, False),
        ("woken without weights", ShardState.WAKING, False),
        ("shrunk", ShardState.ASLEEP, False),
        ("woken with weights", ShardState.ACTIVE, True),
        ("shrunk again", ShardState.ASLEEP, False),
    ]
    tags = [(t.op, set(t.sleeping), t.device_bytes) for t in engine.transitions]
    W, KV = "weights", "kv_cache"
    assert tags == [
        ("sleep(2)", {W, KV}, 0),  # the worker's start-up sleep
        ("wake_up(['weights'])", {KV}, 10),  # weights held, KV cache asleep, not scheduling
        ("pause(keep)", {KV}, 10),
        ("sleep(2)", {W, KV}, 0),  # the executor sleeps the weights, skips the KV cache
        ("wake_up(['weights'])", {KV}, 10),
        ("load(0)", {KV}, 10),
        ("wake_up(['kv_cache'])", set(), 110),  # fully awake: the scheduler runs again
        ("resume", set(), 110),
        ("pause(keep)", set(), 110),
        ("sleep(2)", {W, KV}, 0),
    ]
    assert not any(t.note for t in engine.transitions)  # no call vLLM would ignore


async def test_a_failed_load_at_wake_leaves_both_tags_asleep(ipc_ep: str) -> None:
    from helpers.shard_cycles import failed_load_then_wake

    cache = WeightCache("P", f"st{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
    engine = ScriptedEngine(weights_bytes=10, kv_bytes=100)
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        worker = await ShardWorker(engine, co.endpoint, "P", 0, sleep_level=2).start()
        try:
            cache.build(0, {"w": torch.ones(64, 64)})
            good = cache.promote(0)
            engine.load_error = "midway"
            seen, error = await failed_load_then_wake(worker, good, good)
        finally:
            await worker.close()
            cache.close()
    assert isinstance(error, RuntimeError) and "mid-load" in str(error)
    failed = seen[1]
    assert failed.state == ShardState.ASLEEP and not failed.weights_valid
    after_failure = engine.transitions[2]  # after the start-up sleep and the wake
    assert after_failure.op == "sleep(2)" and set(after_failure.sleeping) == {"weights", "kv_cache"}
    assert after_failure.device_bytes == 0 and not after_failure.note
    assert seen[2].state == ShardState.ACTIVE and seen[2].version == 0


async def test_a_sleep_during_a_sync_runs_after_it(ipc_ep: str) -> None:
    from helpers.shard_cycles import command, sleep_during_a_sync

    cache = WeightCache("P", f"st{uuid.uuid4().hex[:6]}", bucket_bytes=16 << 10)
    engine = ScriptedEngine(weights_bytes=10, kv_bytes=100, load_delay_s=0.2)
    async with Coordinator(ipc_ep, ClusterShape(1, 1)) as co:
        worker = await ShardWorker(engine, co.endpoint, "P", 0, sleep_level=1).start()
        try:
            cache.build(0, {"w": torch.ones(64, 64)})
            await command(worker, "wake", cache.promote(0))
            cache.build(1, {"w": torch.zeros(64, 64)})
            seen = await sleep_during_a_sync(worker, cache.promote(1))
        finally:
            await worker.close()
            cache.close()
    assert [(s.step, s.state, s.version) for s in seen] == [
        ("awake", ShardState.ACTIVE, 0),
        ("synced", ShardState.ACTIVE, 1),
        ("slept", ShardState.ASLEEP, 1),  # level 1: the version is kept
    ]
    ops = [t.op for t in engine.transitions]
    assert ops.index("load(1)") < len(ops) - 1 - ops[::-1].index("sleep(1)")
    last = engine.transitions[-1]
    assert set(last.sleeping) == {"weights", "kv_cache"} and last.host_bytes == 10


async def test_two_runs_of_one_pipeline_id_on_one_machine_keep_their_own_data_planes() -> None:
    """Two launches of the same pipeline ids as one user (two demos at once): each
    shard worker's ipc data plane is its own. With one path per (pipeline, rank) the
    second bind took the first run's path, and its requests."""
    from rlix_async.security import ipc_endpoint

    async with (
        Coordinator(ipc_endpoint(f"t-{uuid.uuid4().hex[:8]}"), ClusterShape(1, 1)) as one,
        Coordinator(ipc_endpoint(f"t-{uuid.uuid4().hex[:8]}"), ClusterShape(1, 1)) as two,
    ):
        first = await ShardWorker(ScriptedEngine(), one.endpoint, "P", 0).start()
        second = await ShardWorker(ScriptedEngine(), two.endpoint, "P", 0).start()
        try:
            assert first.data.endpoint != second.data.endpoint
            for worker in (first, second):
                path = Path(worker.data.endpoint.removeprefix("ipc://"))
                assert await asyncio.to_thread(path.is_socket), path
        finally:
            await first.close()
            await second.close()
