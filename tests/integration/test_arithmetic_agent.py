"""The arithmetic agent recipe's episodes (rlix_async/recipes/arithmetic_agent.py)
through the pipeline's real OpenAI-compatible server; the model's turns are scripted
(``scripted_generate``: the router needs shards)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers.episodes import CHAT, TOKENIZER, decode, ids, scripted_generate

from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.agents import load_agent
from rlix_async.rollout.episodes import Episode

pytest.importorskip("openai")
ROW = {"prompt": "What is 7 + 4? Answer with just the number.", "answer": 11}


async def episode(turns: list[str], seen: list[list[int]]) -> Episode:
    from rlix_async.rollout.api_agents import ApiAgentRunner

    agent = load_agent(
        "rlix_async.recipes.arithmetic_agent:solve", {"attempts": 3}, client="client"
    )
    runner = ApiAgentRunner(agent, CHAT, TOKENIZER, host="127.0.0.1", model_name="p",
                            max_turns=3, max_tokens=16, max_episode_tokens=400,
                            step_timeout_s=5.0)  # fmt: skip
    sampling = Sampling(max_tokens=16, temperature=1.0, top_p=1.0)
    try:
        return await runner.run(ROW, scripted_generate(turns, seen), sampling)
    finally:
        assert runner.server is not None
        await runner.server.stop()


@pytest.mark.parametrize(
    ("turns", "want"),
    [
        (["11"], {"reward": 1.0, "first_correct": 1.0, "after_feedback": 0.0, "attempts": 1}),
        (["9", "11"], {"reward": 1.0, "first_correct": 0.0, "after_feedback": 1.0, "attempts": 2}),
        (
            ["x", "5", "6"],
            {"reward": 0.0, "first_correct": 0.0, "after_feedback": 0.0, "attempts": 3},
        ),
    ],
    ids=["first", "after-feedback", "never"],
)
async def test_an_episode_is_answers_and_the_checkers_feedback(
    turns: list[str], want: dict[str, Any]
) -> None:
    seen: list[list[int]] = []
    ep = await episode(turns, seen)
    assert ep.reward == want.pop("reward") and ep.turns == len(turns)
    assert ep.info == {k: float(v) for k, v in want.items()}
    if len(turns) > 1:  # the checker's words between the model's turns, in one trajectory
        told = decode(seen[1])
        first = (
            "No, 9 is wrong. Try again: " if turns[0] == "9" else "Answer with just the number. "
        )
        assert first + ROW["prompt"] in told
        assert ep.splits == 0 and sum(ep.mask) == sum(len(ids(t)) for t in turns)
