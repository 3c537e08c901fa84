"""Multi-turn episodes through the real router: a shrink mid-turn resumes that turn on
another shard, and no token is lost or decoded twice.

Shard workers run the scripted engine (a test double: a shrink landing mid-turn under
eight concurrent episodes on two engines does not fit this machine with vLLM; the
launch test in test_env_recipe.py runs episodes on vLLM). Coordinator, workers,
sockets, router, chat template and episode runner are the real ones.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers.cluster import joined_pipeline
from helpers.scripted_engine import ScriptedEngine
from helpers.tiny_text import tiny_tokenizer

from rlix_async.control.coordinator import Coordinator
from rlix_async.protocols.messages import ShardState
from rlix_async.protocols.topology import ClusterShape, ClusterSpec
from rlix_async.rollout.chat import ChatTurns
from rlix_async.rollout.episodes import EpisodeRunner, StepResult, load_env
from rlix_async.shards.router import Router
from rlix_async.shards.worker import ShardWorker
from rlix_async.transport import TransportConfig

TOPO = {"actor_train": ClusterSpec(1, (0,)), "actor_infer": ClusterSpec(1, (0, 1))}
TOKENIZER = tiny_tokenizer()
TURN_TOKENS = 60  # 0.6 s a turn: the shrink lands mid-turn even on a loaded machine
# The whole cluster shares the test's event loop: coordinator, both shards, the driver,
# the router and, for the API agent, its server and eight clients. Beside the suite's
# engine tests on 2 cores that loop stalled past the default 2.5 s heartbeat timeout:
# every peer was declared dead, the lost shards were fenced and put to sleep, and the
# episodes waited for an awake shard until the 90 s deadline. A shrink under running
# turns is what is tested here, not liveness: a peer is dead after 30 s of silence.
TRANSPORT = TransportConfig(heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0)
# the env's (the agent's) own time a turn, bounded only against a hang: a stalled loop
# counts in it, and no bound on it is tested here
STEP_S = 60.0


class ThreeTurns:
    """Replies 'ok' twice, then ends the episode."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.turns = 0

    async def reset(self) -> str:
        return "Go"

    async def step(self, action: str) -> StepResult:
        self.turns += 1
        return StepResult("ok", 1.0, self.turns == 3)


async def _shrunk_under(ipc_ep: str, runner: EpisodeRunner) -> tuple[list[Any], int]:
    """Eight episodes of ``runner`` on two scripted shards; shard 0 shrunk (training
    takes its device) while it decodes their turns. The episodes, and the tokens the
    shards decoded."""
    async with Coordinator(ipc_ep, ClusterShape(1, 2), transport=TRANSPORT) as co:
        driver = await joined_pipeline(co.endpoint, "P", TOPO, transport=TRANSPORT)
        # the engine's token ids stay inside the tokenizer's vocabulary (decoded as actions)
        workers = [
            await ShardWorker(
                ScriptedEngine(token_delay_s=0.01, vocab=250),
                co.endpoint,
                "P",
                r,
                sleep_level=1,
                transport=TRANSPORT,
            ).start()
            for r in range(2)
        ]
        router = Router(driver, transport=TRANSPORT)
        try:
            await driver.report_progress(8, 0, force=True)
            # deadlines on events, generous: a loaded host slows every step here
            await driver.request("actor_infer", "GENERATION", timeout=30)
            episodes = [asyncio.ensure_future(runner.run({}, router.generate)) for _ in range(8)]
            async with asyncio.timeout(30):
                while workers[0].engine.num_running() < 4 or not workers[0].decoded_tokens:  # noqa: ASYNC110
                    await asyncio.sleep(0.01)
            # training needs device 0: shard 0 is shrunk under its running turns
            await driver.report_progress(8, 8)
            await driver.request("actor_train", "ACTOR_TRAINING", timeout=30)
            done = await asyncio.wait_for(asyncio.gather(*episodes), 90)
            assert workers[0].state == ShardState.ASLEEP
        finally:
            await router.close()
            for w in workers:
                await w.close()
            await driver.close()
    return done, sum(w.decoded_tokens for w in workers)


def _check_whole(done: list[Any], decoded: int) -> None:
    assert all(e.turns == 3 and e.cut == "" and e.reward == 3.0 for e in done)
    cut = [e for e in done if e.resumes]
    assert cut and all(e.ranks[-1] == 1 for e in cut)  # finished on the shard left awake
    for e in done:
        # every turn whole: the cut turn's partial output and its continuation, once each
        runs = _runs(e.mask)
        assert [n for m, n in runs if m] == [TURN_TOKENS] * 3
        assert len(e.logprobs) == len(e.versions) == len(e.token_ids) == len(e.mask)
    model_tokens = sum(sum(e.mask) for e in done)
    assert decoded == model_tokens  # decoded once, all kept


async def test_a_shrink_mid_turn_resumes_the_turn_with_no_token_lost_or_doubled(
    ipc_ep: str,
) -> None:
    runner = EpisodeRunner(
        load_env(f"{__name__}:ThreeTurns"),
        ChatTurns(TOKENIZER),
        lambda ids: str(TOKENIZER.decode(ids)),
        max_turns=5,
        max_tokens=TURN_TOKENS,
        max_episode_tokens=1000,
        step_timeout_s=STEP_S,
    )
    _check_whole(*await _shrunk_under(ipc_ep, runner))


USAGE: list[list[int]] = []  # what each OpenAI-API agent was told its turns used


async def three_requests(row: dict[str, Any], client: Any) -> float:
    """The same episode as ThreeTurns, written against the OpenAI API."""
    messages: list[Any] = [{"role": "user", "content": "Go"}]
    used = []
    for _ in range(3):
        reply = await client.chat.completions.create(model="P", messages=messages)
        used.append(reply.usage.completion_tokens)
        messages += [reply.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "ok"}]  # fmt: skip
    USAGE.append(used)
    return 3.0


async def test_an_openai_api_agent_never_sees_the_shrink_under_its_request(ipc_ep: str) -> None:
    """agent_api: a request cut by a shrink finishes on the other shard as if nothing
    happened: every reply whole (its usage a full turn), the history reused (no split)."""
    pytest.importorskip("aiohttp")
    from rlix_async.rollout.agents import load_agent
    from rlix_async.rollout.api_agents import ApiAgentRunner

    runner = ApiAgentRunner(
        load_agent(f"{__name__}:three_requests", {}, client="client"),
        ChatTurns(TOKENIZER),
        TOKENIZER,
        host="127.0.0.1",
        model_name="P",
        max_turns=5,
        max_tokens=TURN_TOKENS,
        max_episode_tokens=1000,
        step_timeout_s=STEP_S,
    )
    USAGE.clear()
    try:
        done, decoded = await _shrunk_under(ipc_ep, runner)
    finally:
        assert runner.server is not None
        await runner.server.stop()
    _check_whole(done, decoded)
    assert all(e.splits == 0 and not e.segments for e in done)
    assert USAGE == [[TURN_TOKENS] * 3] * 8


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    """(value, length) of each run of equal values."""
    runs: list[tuple[int, int]] = []
    for m in mask:
        if runs and runs[-1][0] == m:
            runs[-1] = (m, runs[-1][1] + 1)
        else:
            runs.append((m, 1))
    return runs
