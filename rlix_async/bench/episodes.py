"""``rlix-async bench episodes``: many concurrent multi-turn episodes on one driver loop.

An env pipeline runs every episode as an asyncio task of its driver: each turn a
router request, an env step, a chat-template render. This measures whether
thousands of them starve the loop that also carries the driver's heartbeats:
a coordinator, one shard (vLLM ``AsyncLLM`` on a real model directory with its
chat template, SmolLM2 by default) and a driver, all on one event loop, run N
episodes of a trivial env (async ``step``; ``turns`` turns each) through the real
``EpisodeRunner`` and ``Router``.

- ``loop_lag_ms_p99`` / ``_max``: how late a 10 ms sleep on that loop wakes up.
- ``heartbeat_gap_s_max``: the longest the coordinator went without hearing from
  the driver (it declares a peer dead after ``heartbeat_timeout_s``).
- ``episodes_per_s``, ``failed``: throughput and episodes that did not finish.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from rlix_async.control.client import PipelineClient
from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols.generation import Sampling
from rlix_async.protocols.messages import driver_identity
from rlix_async.protocols.topology import ClusterName, ClusterShape, ClusterSpec
from rlix_async.rollout.chat import ChatTurns
from rlix_async.rollout.episodes import Env, EpisodeRunner, StepResult
from rlix_async.security import ipc_endpoint
from rlix_async.shards.router import Router
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import TransportConfig

TOPOLOGY: dict[ClusterName, ClusterSpec] = {
    "actor_train": ClusterSpec(1, (0,)),
    "actor_infer": ClusterSpec(1, (0,)),
}
PROBE_S = 0.01


class Countdown:
    """The trivial env: 'go on' until its last turn."""

    def __init__(self, row: dict[str, Any], turns: int) -> None:
        self.left = turns

    async def reset(self) -> str:
        return "Say one word."

    async def step(self, action: str) -> StepResult:
        self.left -= 1
        return StepResult("go on", 1.0, self.left == 0)


async def run_episodes_bench(
    model: str,
    *,
    episodes: int = 1000,
    turns: int = 3,
    max_tokens: int = 4,
    kv_cache_mb: int = 1024,
    heartbeat_interval_s: float = 1.0,
    timeout_s: float = 1800.0,
) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from rlix_async.config import VllmEngineConfig
    from rlix_async.shards.vllm.engine import VllmEngine

    tokenizer = AutoTokenizer.from_pretrained(model)
    pid = f"be{uuid.uuid4().hex[:6]}"
    transport = TransportConfig.with_heartbeat(heartbeat_interval_s)
    engine = VllmEngine(model, VllmEngineConfig(dtype="float32", kv_cache_mb=kv_cache_mb))
    co = Coordinator(ipc_endpoint(f"bench-episodes-{pid}"), ClusterShape(1, 1), transport=transport)
    await co.start()
    driver = await PipelineClient.connect(co.endpoint, pipeline_id=pid, transport=transport)
    router = Router(driver)
    worker: ShardWorker | None = None
    runner: EpisodeRunner | None = None
    probes = _Probes(co, driver_identity(pid))

    try:
        await driver.register(TOPOLOGY)
        await driver.admit()
        worker = await ShardWorker(engine, co.endpoint, pid, 0, sleep_level=1).start()
        runner = _countdown_runner(tokenizer, turns, max_tokens)
        sampling = Sampling(max_tokens=max_tokens)
        await driver.report_progress(episodes, 0, force=True)
        await driver.request("actor_infer", "GENERATION", timeout=120)
        watching = [asyncio.ensure_future(f()) for f in (probes.loop, probes.driver)]
        t0 = time.monotonic()
        results = await asyncio.wait_for(
            asyncio.gather(
                *(runner.run({}, router.generate, sampling, None) for _ in range(episodes)),
                return_exceptions=True,
            ),
            timeout_s,
        )
        wall = time.monotonic() - t0
        probes.stop.set()
        await asyncio.gather(*watching)
    finally:
        if runner is not None:
            runner.close()
        probes.stop.set()
        await router.close()
        if worker is not None:
            await worker.close()
        await driver.close()
        await co.close()
        engine.shutdown()
    done = [r for r in results if not isinstance(r, BaseException)]
    lags = sorted(probes.lags)
    return {
        "model": model,
        "episodes": episodes,
        "turns": turns,
        "max_tokens": max_tokens,
        "wall_s": round(wall, 1),
        "episodes_per_s": round(len(done) / wall, 1),
        "turns_per_s": round(sum(e.turns for e in done) / wall, 1),
        "failed": episodes - len(done),
        "loop_lag_ms_p50": round(statistics.median(lags) * 1000, 1),
        "loop_lag_ms_p99": round(lags[int(0.99 * (len(lags) - 1))] * 1000, 1),
        "loop_lag_ms_max": round(lags[-1] * 1000, 1),
        "heartbeat_gap_s_max": round(max(probes.gaps, default=0.0), 2),
        "heartbeat_timeout_s": transport.heartbeat_timeout_s,
    }


def _countdown_runner(tokenizer: Any, turns: int, max_tokens: int) -> EpisodeRunner:
    return EpisodeRunner(
        Env(Countdown, {"turns": turns}, "Countdown"),
        ChatTurns(tokenizer),
        lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
        max_turns=turns,
        max_tokens=max_tokens,
        max_episode_tokens=turns * (max_tokens + 32),
        step_timeout_s=30.0,
    )


class _Probes:
    """What the run does to the driver's event loop: how late a short sleep wakes
    (``lags``), and how long the coordinator goes without hearing the driver (``gaps``)."""

    def __init__(self, co: Coordinator, driver: str) -> None:
        self.co, self.driver_id = co, driver
        self.lags: list[float] = []
        self.gaps: list[float] = []
        self.stop = asyncio.Event()

    async def loop(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            await asyncio.sleep(PROBE_S)
            self.lags.append(time.monotonic() - t - PROBE_S)

    async def driver(self) -> None:
        while not self.stop.is_set():  # what the coordinator last heard from the driver
            peer = self.co.server.peers.get(self.driver_id)
            if peer is None:  # declared dead (or never there): the worst gap
                self.gaps.append(math.inf)
                return
            self.gaps.append(time.monotonic() - peer.last_seen)
            await asyncio.sleep(0.05)


def format_episodes_result(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"{r['episodes']} concurrent episodes x {r['turns']} turns x {r['max_tokens']} tokens "
            f"on one vLLM shard ({Path(r['model']).name}), one event loop",
            f"  wall_s               {r['wall_s']:8.1f}",
            f"  episodes_per_s       {r['episodes_per_s']:8.1f}   turns_per_s {r['turns_per_s']:.1f}",
            f"  failed               {r['failed']:8d}",
            f"  loop_lag_ms p50/p99/max  {r['loop_lag_ms_p50']:.1f} / {r['loop_lag_ms_p99']:.1f}"
            f" / {r['loop_lag_ms_max']:.1f}",
            f"  heartbeat_gap_s_max  {r['heartbeat_gap_s_max']:8.2f}   (dead after "
            f"{r['heartbeat_timeout_s']:g} s)",
        ]
    )
