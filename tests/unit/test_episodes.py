"""Multi-turn episodes (rollout/episodes.py, rollout/chat.py) and the calculator tool.

The runner is driven by ``scripted_generate``, a stand-in for the router's
``generate`` (the router needs a coordinator and shards: tests/integration/
test_episode_resume.py runs episodes through the real one). The tokenizer and its chat
template are real (helpers/tiny_text.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.episodes import CHAT, TOKENIZER, decode, ids, scripted_generate

from rlix_async.config import ConfigError, PipelineConfig, convert
from rlix_async.recipes.calculator import CalcError, Calculator, evaluate
from rlix_async.rollout.chat import ChatError, ChatTurns
from rlix_async.rollout.episodes import (
    EnvError,
    EnvFailure,
    Episode,
    EpisodeRunner,
    StepResult,
    episode_stats,
    load_env,
    pack,
    turns_of,
)

pytestmark = pytest.mark.usefixtures("steady_gc")  # timed heartbeats (conftest)


class Echo:
    """Replies 'got: ACTION'; done once the model says 'stop'; turn n is rewarded n."""

    def __init__(self, row: dict[str, Any], *, log: list[str] | None = None) -> None:
        self.row, self.log = row, log if log is not None else []

    async def reset(self) -> str:
        return f"Question {self.row['q']}"

    async def step(self, action: str) -> StepResult:
        self.log.append(action)
        return StepResult(f"got: {action}", float(len(self.log)), "stop" in action)


def runner(cls: type, **limits: Any) -> EpisodeRunner:
    env = load_env(f"{__name__}:{cls.__name__}", limits.pop("env_args", {}))
    settings: dict[str, Any] = dict(
        max_turns=4, max_tokens=16, max_episode_tokens=400, step_timeout_s=5.0
    )
    settings.update(limits)
    return EpisodeRunner(env, CHAT, decode, **settings)


async def test_an_episode_keeps_the_models_tokens_and_masks_the_envs() -> None:
    log: list[str] = []
    seen: list[list[int]] = []
    r = runner(Echo, env_args={"log": log})
    ep = await r.run({"q": 7}, scripted_generate(["a b", "c", "stop"], seen))
    assert ep.turns == 3 and ep.cut == "" and ep.reward == 1.0 + 2.0 + 3.0
    assert log == ["a b", "c", "stop"]  # the env got the model's text
    assert ep.prompt_ids == CHAT.first("Question 7")
    # each turn is generated over the episode so far, never a re-rendered history
    assert seen[1] == ep.prompt_ids + ep.token_ids[: len(seen[1]) - len(ep.prompt_ids)]
    assert seen[2][: len(seen[1])] == seen[1]
    model = [t for t, m in zip(ep.token_ids, ep.mask, strict=True) if m]
    assert model == ids("a b") + ids("c") + ids("stop")
    assert [v for v, m in zip(ep.versions, ep.mask, strict=True) if not m] == [3] * (
        len(ep.mask) - sum(ep.mask)
    )  # an env token is as old as the turn it answers
    assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if not m)
    # the whole episode renders as the chat template renders the conversation
    chat = [{"role": "user", "content": "Question 7"}]
    for action in ("a b", "c"):
        chat += [
            {"role": "assistant", "content": action},
            {"role": "user", "content": f"got: {action}"},
        ]
    whole = TOKENIZER.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert TOKENIZER.decode(ep.prompt_ids + ep.token_ids).startswith(whole)
    turns = turns_of(ep.token_ids, ep.mask, decode)
    assert [next(iter(t)) for t in turns] == ["model", "env", "model", "env", "model"]
    assert turns[0]["model"] == "a b" and "got: a b" in turns[1]["env"]


async def test_limits_cut_an_episode_and_say_which() -> None:
    r = runner(Echo, max_turns=2)
    ep = await r.run({"q": 1}, scripted_generate(["x", "y", "z"], []))
    assert ep.turns == 2 and ep.cut == "max_turns" and ep.reward == 1.0 + 2.0
    assert ep.mask[-1] == 1  # no env reply after the last turn: nothing to answer
    r = runner(Echo, max_episode_tokens=12, max_tokens=8)
    ep = await r.run({"q": 1}, scripted_generate(["one two three"] * 4, []))
    assert ep.cut == "max_episode_tokens" and len(ep.token_ids) <= 12
    ep = await runner(Echo, reward="last").run({"q": 1}, scripted_generate(["a", "b", "stop"], []))
    assert ep.reward == 3.0  # the last step's, not the sum (6) nor the first (1)
    # the context bounds a turn too: the engine would refuse a longer request
    r = runner(Echo, context_tokens=len(CHAT.first("Question 1")) + 5, max_tokens=8)
    seen: list[list[int]] = []
    ep = await r.run({"q": 1}, scripted_generate(["one two three four five six"] * 3, seen))
    assert (
        ep.cut == "max_episode_tokens"
        and len(ep.prompt_ids) + len(ep.token_ids) <= r.context_tokens
    )
    assert ep.mask[-1] == 1  # no env reply left dangling without room for a turn after it
    with pytest.raises(EnvFailure, match="leaves no room to answer"):  # never a 0 reward
        await runner(Echo, context_tokens=3).run({"q": 1}, scripted_generate(["a"], []))


class Raises(Echo):
    async def step(self, action: str) -> StepResult:
        raise KeyError("no such tool")


class Slow(Echo):
    def step(self, action: str) -> StepResult:  # plain: runs in a thread
        time.sleep(1.0)
        return StepResult(None, 0.0, True)


class WrongType(Echo):
    async def step(self, action: str) -> StepResult:
        return {"reward": 1}  # type: ignore[return-value]


class Tuple(Echo):
    def step(self, action: str) -> Any:
        return None, 0.5, True


class Mapped(Echo):
    def step(self, action: str) -> Any:
        return {"observation": None, "reward": 0.75, "done": True, "info": {"k": 2}}


class Plain(Echo):
    """The issue's env: a plain object with the right attributes, not a StepResult."""

    def step(self, action: str) -> Any:
        class Result:
            observation, reward, done = None, 0.125, True

        return Result()


class Gymnasium(Echo):
    def step(self, action: str) -> Any:
        import numpy as np

        return "obs", 0.25, np.bool_(False), np.bool_(True), {}  # truncated: the end too


async def test_a_failing_env_fails_its_episode_only_and_is_logged_once_with_its_row(
    caplog: pytest.LogCaptureFixture,
) -> None:
    r = runner(Raises)
    with caplog.at_level(logging.ERROR, "rlix_async.episodes"):
        for _ in range(3):
            with pytest.raises(EnvFailure, match=r"step\(\) raised KeyError"):
                await r.run({"q": 5}, scripted_generate(["a"], []))
    assert r.failures == 3
    # its own logger's records: a thread left by another test may log meanwhile
    (record,) = [x for x in caplog.records if x.name == "rlix_async.episodes"]
    assert "'q': 5" in record.getMessage() and record.exc_info is not None
    with pytest.raises(EnvFailure, match=r"step\(\) took longer than 0.2 s"):
        await runner(Slow, step_timeout_s=0.2).run({"q": 1}, scripted_generate(["a"], []))
    with pytest.raises(EnvFailure, match=r"WrongType.step\(\) returned dict"):
        await runner(WrongType).run({"q": 1}, scripted_generate(["a"], []))
    ep = await runner(Tuple).run({"q": 1}, scripted_generate(["a"], []))
    assert ep.reward == 0.5 and ep.turns == 1  # the gym-style tuple is accepted
    ep = await runner(Gymnasium).run({"q": 1}, scripted_generate(["a"], []))
    assert ep.reward == 0.25 and ep.turns == 1 and ep.cut == ""  # and gymnasium's, numpy bools
    ep = await runner(Mapped).run({"q": 1}, scripted_generate(["a"], []))
    assert ep.reward == 0.75 and ep.info == {"k": 2.0}  # a mapping
    ep = await runner(Plain).run({"q": 1}, scripted_generate(["a"], []))
    assert ep.reward == 0.125 and ep.cut == ""  # any object with the attributes


class Exits(Echo):
    def step(self, action: str) -> StepResult:  # plain: runs in a thread
        raise SystemExit(3)


class AsyncExits(Echo):
    async def step(self, action: str) -> StepResult:
        import sys

        sys.exit("bye")


async def test_an_env_calling_exit_fails_its_episode_not_the_driver() -> None:
    """SystemExit from an env (in a thread or on the loop) would leave the driver's
    event loop and take every pipeline's trajectories with it."""
    for cls, code in ((Exits, "3"), (AsyncExits, "'bye'")):
        with pytest.raises(EnvFailure, match=rf"step\(\) raised CalledExit: called exit\({code}\)"):
            await runner(cls).run({"q": 1}, scripted_generate(["a"], []))
    ep = await runner(Echo).run({"q": 1}, scripted_generate(["stop"], []))
    assert ep.turns == 1  # and the loop goes on


def test_a_bad_env_is_one_line_at_load() -> None:
    with pytest.raises(EnvError, match="no such file"):
        load_env("/nonexistent/env.py:Env")
    with pytest.raises(EnvError, match="not a class"):
        load_env(f"{__name__}:decode")
    with pytest.raises(EnvError, match="cannot be built as Echo"):
        load_env(f"{__name__}:Echo", {"nope": 1})
    with pytest.raises(EnvError, match="has no reset"):
        load_env(f"{__name__}:ChatError")


def test_an_env_pipeline_config_is_checked() -> None:
    base: dict[str, Any] = {
        "id": "p",
        "clusters": {"actor_train": {"devices": [0]}, "actor_infer": {"devices": [0]}},
        "model": {"path": "m"},
        "data": {"train": "t.jsonl"},
    }
    cfg = convert({**base, "env": {"env_class": "e.py:E", "max_turns": 3}}, PipelineConfig, "c")
    assert cfg.env.env_class == "e.py:E" and cfg.env.max_turns == 3
    with pytest.raises(ConfigError, match=r"env\.env_class: reward and env_class: name one"):
        env = {"env_class": "e.py:E", "reward": "exact_match"}
        convert({**base, "env": env}, PipelineConfig, "cfg")
    with pytest.raises(ConfigError, match=r"env\.env_args: needs env_class"):
        env = {"reward": "exact_match", "env_args": {"a": 1}}
        convert({**base, "env": env}, PipelineConfig, "cfg")
    with pytest.raises(ConfigError, match=r"env\.max_turns"):
        convert({**base, "env": {"env_class": "e.py:E", "max_turns": 0}}, PipelineConfig, "cfg")
    with pytest.raises(
        ConfigError, match=r"env: a section now: the environment class is env\.env_class"
    ):
        convert({**base, "env": "e.py:E"}, PipelineConfig, "cfg")  # as configs wrote it before
    with pytest.raises(ConfigError, match=r"max_turns: unknown key \(it is env.max_turns now\)"):
        convert({**base, "max_turns": 3}, PipelineConfig, "cfg")


def test_episode_stats_are_means_a_p90_and_cut_counts() -> None:
    figures = {
        "turns": [1.0] * 9 + [10.0],
        "env_s": [0.5] * 10,
        "model_tokens": [4.0] * 10,
        "env_tokens": [2.0] * 10,
        "cut_turns": [0.0] * 9 + [1.0],
        "cut_tokens": [0.0] * 10,
    }
    figures["info/calls"] = [math.nan] * 9 + [4.0]  # reported by one episode's last step
    s = episode_stats(figures)
    assert s["env/calls"] == 4.0  # the mean of those that reported it
    assert s["turns_mean"] == pytest.approx(1.9) and s["turns_p90"] == 1.0
    assert s["turns_max"] == 10.0 and s["cut_max_turns"] == 1.0
    assert episode_stats({}) == {}


@pytest.mark.parametrize(
    ("expression", "value"),
    [("37 * 24", 888), ("(1 + 2) * -3", -9), ("7 / 2", 3.5), ("8 / 4", 2), ("1.5+1.5", 3)],
)
def test_the_calculator_computes_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('true')", "only numbers"),
        ("2 ** 10", "only numbers"),
        ("x + 1", "only numbers"),
        ("True + 1", "only numbers"),
        ("1 / 0", "division by zero"),
        ("1" * 201, "longer than 200"),
        ("+".join(["1"] * 40), "more than 64 parts"),
        ("99999999 * 99999999 * 99999999", "too large"),
        ("1 +", "not an arithmetic expression"),
        ("\ud800", "not an arithmetic expression"),
    ],
)
def test_the_calculator_refuses_anything_else(expression: str, why: str) -> None:
    with pytest.raises(CalcError, match=why):
        evaluate(expression)


def test_the_calculator_env_answers_tool_calls_and_scores_the_final_answer() -> None:
    env = Calculator({"question": "What is 37 * 24?", "answer": 888})
    assert "What is 37 * 24?" in env.reset() and "<calc>" in env.reset()
    result = env.step("Let me compute. <calc>37*24</calc>")
    assert (result.observation, result.reward, result.done) == ("<result>888</result>", 0.0, False)
    assert env.step("<calc>37 ** 24</calc>").observation == (
        "<error>only numbers, + - * / and parentheses</error>"
    )
    assert env.step("hmm").done is False  # neither a call nor a number: a reminder
    assert env.step("The answer is 888").reward == 1.0
    assert Calculator({"question": "q", "answer": 888}).step("887").reward == 0.0


async def test_the_calculator_runs_as_a_pipeline_env_from_its_module_path() -> None:
    env = load_env("rlix_async.recipes.calculator:Calculator")
    r = EpisodeRunner(
        env, CHAT, decode, max_turns=4, max_tokens=32, max_episode_tokens=400, step_timeout_s=5.0
    )
    row = {"question": "What is 12 + 30?", "answer": 42}
    ep = await r.run(row, scripted_generate(["<calc>12+30</calc>", "42"], []))
    assert ep.turns == 2 and ep.reward == 1.0 and ep.figures()["info/calls"] == 1.0
    assert "<result>42</result>" in turns_of(ep.token_ids, ep.mask, decode)[1]["env"]


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    class Plain:
        chat_template = None

    with pytest.raises(ChatError, match="needs a tokenizer with a chat template"):
        ChatTurns(Plain())


async def test_a_timed_out_step_holds_an_env_thread_never_one_of_the_loops() -> None:
    """Env threads are the runner's own (the loop's default pool runs the trainer's
    steps): a stuck step is counted there, and frees its thread when it returns."""
    r = runner(Slow, step_timeout_s=0.2, max_threads=2)
    loop_pool = asyncio.get_running_loop()._default_executor  # type: ignore[attr-defined]
    with pytest.raises(EnvFailure, match="took longer"):
        await r.run({"q": 1}, scripted_generate(["a"], []))
    assert r.stuck == 1 and asyncio.get_running_loop()._default_executor is loop_pool  # type: ignore[attr-defined]
    await asyncio.sleep(1.2)
    assert r.stuck == 0
    r.close()


def test_a_qwen3_style_template_renders_replies_from_a_user_only_base() -> None:
    """Qwen3 renders the last assistant turn with an empty think block and earlier ones
    without: the user-only base still renders replies exactly as the whole chat."""
    import copy

    tok = copy.deepcopy(TOKENIZER)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and "
        "loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    chat = ChatTurns(tok)
    assert chat.base == [{"role": "user", "content": "?"}]
    first, model = chat.first("Q"), tok("A<|im_end|>", add_special_tokens=False)["input_ids"]
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "R"},
        ],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tok.decode(first + model + chat.reply("R", model)) == whole
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatError, match="chat template failed"):
        ChatTurns(tok)


def test_steps_run_off_the_event_loop() -> None:
    """A plain env's slow step runs in a thread: the loop keeps ticking meanwhile."""

    async def main() -> int:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        await runner(Slow, step_timeout_s=5.0).run({"q": 1}, scripted_generate(["a"], []))
        ticker.cancel()
        return ticks

    assert asyncio.run(main()) >= 10


def test_a_group_of_episodes_shares_their_common_prompt_and_masks_the_rest() -> None:
    a = Episode([1, 2, 3, 4], [10, 11, 12], [-1.0, 0.0, -2.0], [5, 5, 6], mask=[1, 0, 1])
    b = Episode([1, 2, 7], [20], [-3.0], [4], mask=[1])
    packed = pack([a, b])
    assert packed.prompt == [1, 2]
    assert packed.responses == [[3, 4, 10, 11, 12], [7, 20]]
    assert packed.masks == [[0, 0, 1, 0, 1], [0, 1]]  # the rest of a first turn: context only
    assert packed.logprobs == [[0.0, 0.0, -1.0, 0.0, -2.0], [0.0, -3.0]]
    assert packed.versions == [[5, 5, 5, 5, 6], [4, 4]]
    same = pack([a, Episode([1, 2, 3, 4], [9], [-1.0], [5], mask=[1])])
    assert same.prompt == [1, 2, 3, 4] and same.masks == [[1, 0, 1], [1]]
