"""The scripted test engine behaves like vLLM V1 (0.32) tag by tag (its docstring cites
the vLLM code it mirrors), so that worker paths tested against it are the paths vLLM
has. Each test would fail against a double that treated any wake as fully awake or
any sleep as effective."""

from __future__ import annotations

import asyncio

import pytest
from helpers.scripted_engine import EngineCrashed, ScriptedEngine

from rlix_async.protocols.generation import Sampling

W, KV = "weights", "kv_cache"


async def test_a_fresh_engine_is_awake_and_sleep_releases_both_tags() -> None:
    engine = ScriptedEngine(weights_bytes=10, kv_bytes=100)
    assert not engine.asleep and engine.device_bytes == 110
    await engine.sleep(1)
    last = engine.transitions[-1]
    assert last.sleeping == {W, KV} and last.device_bytes == 0
    assert last.host_bytes == 10  # level 1: the weights went to host memory
    assert last.scheduler_paused


async def test_wake_without_weights_keeps_the_scheduler_paused_until_every_tag_wakes() -> None:
    engine = ScriptedEngine(weights_bytes=10, kv_bytes=100)
    await engine.sleep(2)
    await engine.wake_up([W])
    woken = engine.transitions[-1]
    assert woken.sleeping == {KV} and woken.device_bytes == 10 and woken.host_bytes == 0
    assert woken.scheduler_paused  # a partial wake keeps scheduling off
    await engine.wake_up([KV])
    full = engine.transitions[-1]
    assert full.sleeping == frozenset() and full.device_bytes == 110
    assert not full.scheduler_paused


async def test_a_shrink_after_a_wake_without_weights_sleeps_what_is_awake() -> None:
    """The executor sleeps (weights are not a sleeping tag) and skips the KV cache,
    already asleep: both tags sleep after, nothing is held."""
    engine = ScriptedEngine(weights_bytes=10, kv_bytes=100)
    await engine.sleep(2)
    await engine.wake_up([W])
    await engine.pause("keep")
    await engine.sleep(2)
    last = engine.transitions[-1]
    assert last.op == "sleep(2)" and not last.note
    assert last.sleeping == {W, KV} and last.device_bytes == 0


async def test_a_sleep_while_the_weights_sleep_is_a_no_op() -> None:
    """Executor.sleep returns early while 'weights' sleeps: a level-2 sleep after a
    level-1 one leaves the weights in host memory (not discarded)."""
    engine = ScriptedEngine(weights_bytes=10, kv_bytes=100)
    engine.weight_version = 3
    await engine.sleep(1)
    await engine.sleep(2)
    last = engine.transitions[-1]
    assert last.note == "Executor is already sleeping." and last.host_bytes == 10
    assert engine.weight_version == 3  # level 1 kept them


async def test_waking_a_tag_that_is_not_asleep_does_nothing() -> None:
    engine = ScriptedEngine(weights_bytes=10, kv_bytes=100)
    await engine.sleep(2)
    await engine.wake_up([W])
    await engine.wake_up([W, KV])  # weights are awake already: the whole call is refused
    last = engine.transitions[-1]
    assert "not in sleeping tags" in last.note and last.sleeping == {KV}


async def test_level_two_discards_the_weights_and_level_one_restores_them() -> None:
    engine = ScriptedEngine()
    engine.weight_version = 5
    await engine.sleep(2)
    await engine.wake_up()
    assert engine.weight_version is None
    engine.weight_version = 6
    await engine.sleep(1)
    await engine.wake_up()
    assert engine.weight_version == 6


async def test_a_resume_under_a_sleeping_tag_crashes_the_first_decode() -> None:
    """resume_generation unpauses the scheduler whatever sleeps; decoding with the KV
    cache unmapped is what kills vLLM's engine on CUDA."""
    engine = ScriptedEngine(token_delay_s=0.001)
    await engine.sleep(2)
    await engine.wake_up([W])
    await engine.resume()
    with pytest.raises(EngineCrashed, match="kv_cache"):
        async for _ in engine.generate([1], Sampling(max_tokens=2)):
            pass


async def test_a_paused_scheduler_runs_nothing_and_an_abort_pause_ends_requests() -> None:
    engine = ScriptedEngine(token_delay_s=0.001)
    await engine.pause("abort")
    stream = engine.generate([1], Sampling(max_tokens=3))
    task = asyncio.ensure_future(stream.__anext__())
    await asyncio.sleep(0.05)
    assert not task.done()  # queued: PAUSED_NEW schedules nothing
    await engine.resume()
    chunk = await task
    assert chunk.token_ids == [1]


async def test_loading_weights_that_sleep_crashes() -> None:
    from rlix_async.protocols.cache_ref import CacheRef

    engine = ScriptedEngine()
    await engine.sleep(2)
    ref = CacheRef("P", "o", 1, "seg", 2, "fp", 0, "host")
    with pytest.raises(EngineCrashed, match="while they sleep"):
        await engine.load_version(ref)
