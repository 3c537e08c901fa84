"""Agent functions (rollout/agents.py): your own loop over a conversation that owns the
token ids, bounded by the pipeline's limits. Driven by ``scripted_generate`` (the
router needs shards; see tests/helpers/episodes.py)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import pytest
from helpers.episodes import CHAT, TOKENIZER, ids, scripted_generate

from rlix_async.config import ConfigError, PipelineConfig, convert
from rlix_async.rollout.agents import AgentClient, AgentRunner, EpisodeOver, load_agent
from rlix_async.rollout.episodes import EnvError, EnvFailure


async def tool_agent(row: dict[str, Any], llm: AgentClient, bonus: float = 0.0) -> float:
    chat = llm.start(row["question"])
    text = await chat.generate()
    chat.add(f"<result>{text.upper()}</result>")
    answer = await chat.generate(max_tokens=2)
    return (1.0 if answer == "4" else 0.0) + bonus


async def forever(row: dict[str, Any], llm: AgentClient) -> float:
    chat = llm.start([1, 2, 3])  # token ids, as they are
    chat.reward = 0.5  # what stands if a limit ends the episode
    while True:
        await chat.generate()
        chat.add_ids([7, 7])


async def raises(row: dict[str, Any], llm: AgentClient) -> float:
    llm.start("q")
    raise KeyError("my scaffold broke")


async def wrong(row: dict[str, Any], llm: AgentClient) -> Any:
    chat = llm.start("q")
    await chat.generate()
    return "yes"


async def dawdles(row: dict[str, Any], llm: AgentClient) -> float:
    chat = llm.start("q")
    await chat.generate()  # slow (the scripted engine): not the agent's own time
    await asyncio.sleep(1.0)  # its own: past the bound
    return 1.0


async def silent(row: dict[str, Any], llm: AgentClient) -> float:
    llm.start("q")
    return 1.0


def plain(row: dict[str, Any], llm: AgentClient) -> float:
    return 1.0


def runner(fn: Any, **limits: Any) -> AgentRunner:
    settings: dict[str, Any] = dict(
        max_turns=4, max_tokens=16, max_episode_tokens=400, step_timeout_s=5.0
    )
    settings.update(limits)
    agent = load_agent(f"{__name__}:{fn.__name__}", settings.pop("agent_args", {}))
    return AgentRunner(agent, CHAT, TOKENIZER, **settings)


async def test_an_agent_drives_its_conversation_and_the_tokens_stay_its_own() -> None:
    seen: list[list[int]] = []
    r = runner(tool_agent, agent_args={"bonus": 0.25})
    ep = await r.run({"question": "2+2?"}, scripted_generate(["calc 2+2", "4"], seen))
    assert ep.reward == 1.25 and ep.turns == 2 and ep.cut == ""
    assert ep.prompt_ids == CHAT.first("2+2?")
    reply = CHAT.reply("<result>CALC 2+2</result>", ids("calc 2+2"))
    assert ep.token_ids == ids("calc 2+2") + reply + ids("4")
    assert ep.mask == [1] * len(ids("calc 2+2")) + [0] * len(reply) + [1] * len(ids("4"))
    assert seen[1] == ep.prompt_ids + ids("calc 2+2") + reply  # never re-rendered


async def test_a_limit_ends_an_agents_loop_with_the_reward_it_set() -> None:
    ep = await runner(forever, max_turns=3).run({}, scripted_generate(["a"] * 5, []))
    assert ep.prompt_ids == [1, 2, 3] and ep.turns == 3 and ep.cut == "max_turns"
    assert ep.reward == 0.5
    ep = await runner(forever, max_episode_tokens=5).run({}, scripted_generate(["a b c"] * 5, []))
    assert ep.cut == "max_episode_tokens" and len(ep.token_ids) <= 5 + 2


async def test_a_failing_agent_fails_its_episode_only(caplog: pytest.LogCaptureFixture) -> None:
    r = runner(raises)
    with caplog.at_level(logging.ERROR, "rlix_async.episodes"):
        for _ in range(2):
            with pytest.raises(EnvFailure, match="raised KeyError: 'my scaffold broke'"):
                await r.run({"q": 9}, scripted_generate([], []))
    assert r.failures == 2 and len(caplog.records) == 1 and "'q': 9" in caplog.text
    with pytest.raises(EnvFailure, match="returned str 'yes'; expected the episode's reward"):
        await runner(wrong).run({}, scripted_generate(["a"], []))
    with pytest.raises(EnvFailure, match="without a model turn"):
        await runner(silent).run({}, scripted_generate([], []))


async def exits(row: dict[str, Any], llm: AgentClient) -> float:
    await llm.start("q").generate()
    raise SystemExit(2)


async def test_an_agent_calling_exit_fails_its_episode_not_the_driver() -> None:
    """Its task would otherwise re-raise SystemExit out of the driver's event loop."""
    with pytest.raises(EnvFailure, match=r"raised CalledExit: called exit\(2\)"):
        await runner(exits).run({}, scripted_generate(["a"], []))
    ep = await runner(tool_agent).run({"question": "2+2?"}, scripted_generate(["x", "4"], []))
    assert ep.reward == 1.0  # the loop goes on


async def test_only_the_agents_own_time_between_turns_is_bounded() -> None:
    async def slow_generate(prompt_ids: list[int], max_tokens: int, **_: Any) -> Any:
        await asyncio.sleep(0.6)  # the engine's time: longer than the bound, and fine
        return await scripted_generate(["a"], [])(prompt_ids, max_tokens)

    with pytest.raises(EnvFailure, match=r"more than 0.3 s of its own between model turns"):
        await runner(dawdles, step_timeout_s=0.3).run({}, slow_generate)
    ep = await runner(tool_agent, step_timeout_s=0.3).run({"question": "q"}, _twice(slow_generate))
    assert ep.turns == 2


def _twice(generate: Any) -> Any:
    texts = iter(["x", "4"])

    async def two(prompt_ids: list[int], max_tokens: int, **_: Any) -> Any:
        await asyncio.sleep(0.6)
        return await scripted_generate([next(texts)], [])(prompt_ids, max_tokens)

    return two


def test_a_bad_agent_is_one_line_at_load() -> None:
    with pytest.raises(EnvError, match="must be an async def function"):
        load_agent(f"{__name__}:plain")
    with pytest.raises(EnvError, match=r"cannot be called as fn\(row, llm, nope\)"):
        load_agent(f"{__name__}:tool_agent", {"nope": 1})
    with pytest.raises(EnvError, match="no such file"):
        load_agent("/nonexistent/agent.py:solve")
    assert issubclass(EpisodeOver, Exception)


def test_an_agent_pipeline_config_is_checked() -> None:
    base: dict[str, Any] = {
        "id": "p",
        "clusters": {"actor_train": {"devices": [0]}, "actor_infer": {"devices": [0]}},
        "model": {"path": "m"},
        "data": {"train": "t.jsonl"},
    }
    env = {"agent": "a.py:solve", "agent_args": {"k": 1}}
    cfg = convert({**base, "env": env}, PipelineConfig, "c")
    assert cfg.env.agent == "a.py:solve"
    with pytest.raises(ConfigError, match=r"env\.agent: env_class and agent: name one"):
        convert(
            {**base, "env": {"agent": "a.py:solve", "env_class": "e.py:E"}}, PipelineConfig, "c"
        )
    with pytest.raises(ConfigError, match=r"env\.agent_args: needs agent or agent_api"):
        env = {"reward": "exact_match", "agent_args": {"k": 1}}
        convert({**base, "env": env}, PipelineConfig, "c")
    with pytest.raises(ConfigError, match=r"agent: unknown key \(it is env.agent now\)"):
        convert({**base, "agent": "a.py:solve"}, PipelineConfig, "c")


def test_an_agent_pipeline_loads_its_agent_before_any_process_starts(tmp_path: Path) -> None:
    from helpers.tiny_text import save_tiny_model

    from rlix_async.rollout.prompts import RecipeError, load_recipe

    model = save_tiny_model(tmp_path / "m")
    (tmp_path / "t.jsonl").write_text('{"prompt": "2+2?"}\n')
    (tmp_path / "agent.py").write_text("async def solve(row, llm):\n    return 1.0\n")
    raw: dict[str, Any] = {
        "id": "p",
        "clusters": {"actor_train": {"devices": [0]}, "actor_infer": {"devices": [0]}},
        "model": {"path": str(model)},
        "data": {"train": str(tmp_path / "t.jsonl")},
        "env": {"agent": f"{tmp_path / 'agent.py'}:solve"},
    }
    recipe = load_recipe(convert(raw, PipelineConfig, "c"))
    assert isinstance(recipe.episodes, AgentRunner) and recipe.runner is None
    recipe.close()
    (tmp_path / "plain.py").write_text("def solve(row, llm):\n    return 1.0\n")
    with pytest.raises(RecipeError, match=r"env.agent: agent .*must be an async def function"):
        env = {"agent": f"{tmp_path / 'plain.py'}:solve"}
        load_recipe(convert({**raw, "env": env}, PipelineConfig, "c"))


async def two_at_once(row: dict[str, Any], llm: AgentClient) -> float:
    chat = llm.start("q")
    await asyncio.gather(chat.generate(), chat.generate())
    return 1.0


async def test_one_turn_at_a_time_and_router_errors_stay_router_errors() -> None:
    async def slow(prompt_ids: list[int], max_tokens: int, **_: Any) -> Any:
        await asyncio.sleep(0.1)
        return await scripted_generate(["a"], [])(prompt_ids, max_tokens)

    # two turns from one prefix would both be trained on: refused
    with pytest.raises(EnvFailure, match="one model turn at a time"):
        await runner(two_at_once).run({}, slow)

    async def broken(prompt_ids: list[int], max_tokens: int, **_: Any) -> Any:
        raise ConnectionError("shard gone")

    r = runner(tool_agent)
    with pytest.raises(ConnectionError, match="shard gone"):  # a failed request, as anywhere
        await r.run({"question": "q"}, broken)
    assert r.failures == 0
