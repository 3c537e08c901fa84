"""Routing over shard workers with preemption: nothing lost, no decoded token wasted.

Shard workers run the scripted engine (a test double: 32 concurrent requests
on several engines do not fit this machine with vLLM); sockets, coordinator,
workers and router are the real ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest
from helpers.cluster import SCRIPTED_ENGINE, joined_pipeline
from helpers.scripted_engine import ScriptedEngine
from helpers.waits import until

from rlix_async.control.client import PipelineClient
from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols.generation import Cancel, Generate, Sampling
from rlix_async.protocols.messages import ShardState
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.shards.router import Router
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import CallContext

pytestmark = pytest.mark.usefixtures("steady_gc")  # timed heartbeats (conftest)

TOPO = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (0, 1))}


@contextlib.asynccontextmanager
async def two_shards(
    ipc_ep: str, token_delay_s: float
) -> AsyncIterator[tuple[PipelineClient, list[ShardWorker], Router]]:
    """Coordinator, pipeline P joined, two in-process scripted shard workers, a router.
    Nothing publishes weights here: the shards sleep at level 1 (weights kept), so a
    wake serves without a sync."""
    async with Coordinator(ipc_ep, ClusterShape(1, 2)) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO)
        workers = [
            await ShardWorker(
                ScriptedEngine(token_delay_s=token_delay_s), co.endpoint, "P", r, sleep_level=1
            ).start()
            for r in range(2)
        ]
        router = Router(driver)
        try:
            yield driver, workers, router
        finally:
            await router.close()
            for w in workers:
                await w.close()
            await driver.close()


async def test_shrink_with_32_requests_in_flight_resumes_every_one(
    ipc_ep: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with two_shards(ipc_ep, token_delay_s=0.01) as (driver, workers, router):
        prefills: list[tuple[str, int]] = []  # (attempt id, prompt tokens) the engines got
        for w in workers:

            async def recording(
                prompt_ids: list[int],
                sampling: Sampling,
                *,
                _generate: Any = w.engine.generate,
                **kw: Any,
            ) -> Any:
                prefills.append((kw["request_id"], len(prompt_ids)))
                async for chunk in _generate(prompt_ids, sampling, **kw):
                    if chunk.finished:  # routing replay: one byte per input position
                        chunk.routes = _routes([*prompt_ids, *chunk.token_ids])
                    yield chunk

            monkeypatch.setattr(w.engine, "generate", recording)
        await driver.report_progress(32, 0, force=True)
        await driver.request("actor_infer", "GENERATION", timeout=10)
        max_tokens = 100  # 1 s a request: the shrink lands mid-decode even on a loaded machine
        jobs = [
            asyncio.ensure_future(router.generate([i + 1, 7], Sampling(max_tokens=max_tokens)))
            for i in range(32)
        ]

        def started() -> bool:  # all in flight, partly decoded (the engines only count)
            return sum(w.engine.num_running() for w in workers) == 32 and workers[0].decoded_tokens

        async with asyncio.timeout(10):
            while not started():  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        # training needs device 0: shard 0 is shrunk under 16 running requests
        await driver.report_progress(32, 32)
        await driver.request("actor_train", "ACTOR_TRAINING", timeout=10)
        trajs = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert workers[0].state == ShardState.ASLEEP
        assert len(trajs) == 32  # lost_requests == 0
        assert all(len(t.token_ids) == max_tokens for t in trajs)
        assert all(len(t.logprobs) == len(t.versions) == max_tokens for t in trajs)
        cut = [t for t in trajs if t.resumes]
        assert cut and all(t.ranks[-1] == 1 for t in cut)
        decoded = sum(w.decoded_tokens for w in workers)
        kept = sum(len(t.token_ids) for t in trajs)
        assert decoded == kept  # wasted_tokens == 0
        assert {"abort", "drain", "sleep"} <= set(workers[0].phase_ms)
        # re-prefill cost: every resumed attempt (id "<request>.<resumes>", resumes > 0)
        # is prefilled again on its shard from the prompt plus the partial output it carries
        resumed = [n for attempt, n in prefills if not attempt.endswith(".0")]
        assert len(prefills) - len(resumed) == 32  # one first attempt per request
        assert router.resumed == len(resumed) == sum(t.resumes for t in cut)
        assert router.reprefill_tokens == sum(resumed)
        assert router.reprefill_tokens > 2 * len(cut)  # the partial outputs, not the prompts only
        # routes: the last attempt's, over the whole trajectory (its prompt held the rest)
        assert all(t.routes == _routes([*t.prompt_ids, *t.token_ids]) for t in trajs)


def _routes(seq: list[int]) -> bytes:
    """Stand-in routes of positions 0 .. len(seq) - 2 (every input token): each
    position's token, so a route of the wrong position or attempt shows."""
    return bytes(t % 256 for t in seq[:-1])


async def test_callers_wait_while_every_shard_sleeps(ipc_ep: str) -> None:
    async with two_shards(ipc_ep, token_delay_s=0.001) as (driver, _, router):
        pending = asyncio.ensure_future(router.generate([1, 2, 3], Sampling(max_tokens=5)))
        await asyncio.sleep(0.5)
        assert not pending.done()  # no shard awake: it waits, it does not fail
        await driver.report_progress(10, 0, force=True)
        await driver.request("actor_infer", "GENERATION", timeout=10)
        traj = await asyncio.wait_for(pending, 10)
        assert len(traj.token_ids) == 5


@pytest.mark.parametrize("coordinator_timeout_s", [0.5, 4.0])
async def test_killed_shard_process_requests_resume_and_rank_is_freed(
    ipc_ep: str, coordinator_timeout_s: float
) -> None:
    """Shard workers are real processes (`rlix-async shard engine.kind=custom ...`).
    With the coordinator slower to declare the worker dead than the router is to lose
    its connection (4 s against 0.5 s: a loaded host, a launch's longer heartbeat), the
    requests resume on the live shard at once: none goes back to the dead one and waits
    out a connect timeout (30 s, once per request queued behind it)."""
    import os
    import signal
    import subprocess
    import sys

    from rlix_async.transport import TransportConfig

    fast = TransportConfig(heartbeat_interval_s=0.2, heartbeat_timeout_s=0.5)
    coordinator = TransportConfig(
        heartbeat_interval_s=0.2, heartbeat_timeout_s=coordinator_timeout_s
    )
    async with Coordinator(ipc_ep, ClusterShape(1, 2), transport=coordinator) as co:
        driver = await joined_pipeline(co.endpoint, "K", TOPO, transport=fast)

        def spawn(rank: int) -> subprocess.Popen[str]:
            p = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "rlix_async.cli",
                    "shard",
                    "pipeline=K",
                    f"rank={rank}",
                    f"coordinator={co.endpoint}",
                    "heartbeat_interval_s=0.2",
                    "engine.kind=custom",
                    f"engine.custom={SCRIPTED_ENGINE}",
                    "engine.custom_args={token_delay_s: 0.02}",
                    "engine.sleep_level=1",  # nothing publishes weights here: keep them
                ],
                stdout=subprocess.PIPE,
                text=True,
            )
            assert p.stdout is not None and p.stdout.readline().startswith("READY")
            return p

        procs = [await asyncio.to_thread(spawn, r) for r in range(2)]
        router = Router(driver, transport=fast)
        try:
            await driver.report_progress(16, 0, force=True)
            await driver.request("actor_infer", "GENERATION", timeout=10)
            await asyncio.wait_for(_both_awake(driver), 10)
            jobs = [
                asyncio.ensure_future(router.generate([i + 3], Sampling(max_tokens=30)))
                for i in range(16)
            ]
            await asyncio.sleep(0.25)
            os.kill(procs[0].pid, signal.SIGKILL)  # mid-generation
            trajs = await asyncio.wait_for(asyncio.gather(*jobs), 20)
            assert all(len(t.token_ids) == 30 for t in trajs)  # none lost
            assert any(t.resumes for t in trajs) and all(
                t.ranks[-1] == 1 for t in trajs if t.resumes
            )
            # its device is freed once the coordinator declares the worker dead
            await until(lambda: 0 not in co.registry.pipelines["K"].active)
            await until(lambda: 0 not in driver.active_ranks)
        finally:
            await router.close()
            await driver.close()
            for p in procs:
                p.kill()
                p.wait(timeout=10)


async def _both_awake(driver: PipelineClient) -> None:
    while sorted(driver.active_ranks) != [0, 1] or len(driver.endpoints) < 2:
        await driver.wait_ranks_change(timeout=5)


async def test_requests_run_only_on_accepted_weight_versions(ipc_ep: str) -> None:
    """A shard behind the accepted versions refuses before decoding: the request goes to
    one that is current, or waits for the sync. (The versions are set on the workers
    directly, as a finished sync would; tests/integration/test_shard_sync.py covers real syncs.)"""
    async with two_shards(ipc_ep, token_delay_s=0.001) as (driver, workers, router):
        await driver.report_progress(10, 0, force=True)
        await driver.request("actor_infer", "GENERATION", timeout=10)
        workers[0].synced_version, workers[1].synced_version = 0, 1
        trajs = await asyncio.gather(
            *(router.generate([1, 2], Sampling(max_tokens=3), min_version=1) for _ in range(6))
        )
        assert all(t.ranks == [1] and t.versions == [1] * 3 for t in trajs)
        workers[1].synced_version = 0  # both behind: it waits for a sync
        pending = asyncio.ensure_future(router.generate([1], Sampling(max_tokens=3), min_version=1))
        await asyncio.sleep(0.5)
        assert not pending.done()
        workers[0].synced_version = 1
        traj = await asyncio.wait_for(pending, 10)
        assert traj.ranks == [0] and traj.versions == [1] * 3
        impatient = Router(driver, attempt_timeout_s=0.3)
        try:
            with pytest.raises(RuntimeError, match="no shard reached an accepted"):
                await impatient.generate([1], Sampling(max_tokens=3), min_version=9)
        finally:
            await impatient.close()


async def test_cancelled_generate_stops_the_request_on_its_shard(ipc_ep: str) -> None:
    """A caller that gives up (timeout, dropped group) frees the shard's slot at once
    instead of leaving the engine decoding to max_tokens."""
    async with two_shards(ipc_ep, token_delay_s=0.01) as (driver, workers, router):
        await driver.report_progress(10, 0, force=True)
        await driver.request("actor_infer", "GENERATION", timeout=10)
        jobs = [
            asyncio.ensure_future(router.generate([i + 1, 3], Sampling(max_tokens=10_000)))
            for i in range(4)
        ]
        await asyncio.sleep(0.3)
        assert sum(w.engine.num_running() for w in workers) == 4
        for job in jobs[:3]:
            job.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*jobs[:3])
        for _ in range(200):  # the cancel is a notification: give it a moment
            if sum(w.engine.num_running() for w in workers) == 1:
                break
            await asyncio.sleep(0.01)
        assert sum(w.engine.num_running() for w in workers) == 1  # the fourth runs on
        assert sum(w.cancelled for w in workers) == 3 and router.cancelled == 3
        decoded = sum(w.decoded_tokens for w in workers)
        await asyncio.sleep(0.2)
        # only the surviving request still decodes (~20 tokens in 0.2 s, not ~80)
        assert sum(w.decoded_tokens for w in workers) - decoded < 40
        jobs[3].cancel()


async def test_cancel_that_overtakes_its_request_refuses_it(ipc_ep: str) -> None:
    """Generate and Cancel can be read in one batch, before the request's task runs:
    the shard remembers the cancel and refuses the request when it starts."""
    async with two_shards(ipc_ep, token_delay_s=0.01) as (driver, workers, _):
        await driver.report_progress(10, 0, force=True)
        await driver.request("actor_infer", "GENERATION", timeout=10)
        w = workers[0]  # its handlers, called in the order one read batch would
        w._cancel(Cancel(request_ids=["early.0"]), CallContext("router", 0))
        with pytest.raises(Exception, match="cancelled"):
            await w._generate(
                Generate(request_id="early.0", prompt_ids=[1, 2], sampling=Sampling(max_tokens=5)),
                CallContext("router", 1),
            )
        assert w.cancelled == 1 and w.engine.num_running() == 0
