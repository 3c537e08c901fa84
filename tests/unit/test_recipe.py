"""A text recipe's prompts and scoring inside the collector (rollout/prompts.py, collector.py).

Real datasets on disk, the offline tiny tokenizer, real reward runners (threads,
timeouts) and the real ledger; the collector's ``_add`` is driven with finished
trajectories as the router returns them (no shards: what is under test is what
happens to a group once its responses are back).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_text import tiny_tokenizer

from rlix_async.config import PipelineConfig, convert
from rlix_async.rollout.collector import UNIFORM_LIMIT, Collector
from rlix_async.rollout.dataset import PromptDataset, PromptOrder
from rlix_async.rollout.ledger import Ledger, tally
from rlix_async.rollout.prompts import TextPrompts
from rlix_async.rollout.rewards import RewardRunner, load_reward
from rlix_async.shards.router import Trajectory
from rlix_async.train.buffer import ReplayBuffer, StalenessBound

pytest.importorskip("datasets")


@pytest.fixture
def dataset(tmp_path: Path) -> PromptDataset:
    rows = [{"prompt": f"What is {a} + 1?", "answer": a + 1} for a in range(10)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset(path, tiny_tokenizer(), prompt_key="prompt")


def prompts(dataset: PromptDataset, reward: Any, **order: Any) -> TextPrompts:
    runner = RewardRunner(load_reward(reward) if isinstance(reward, str) else reward, timeout_s=2.0)
    return TextPrompts(
        dataset, tiny_tokenizer(), runner, order=PromptOrder(len(dataset), 7, **order)
    )


def test_rows_in_flight_at_a_checkpoint_come_back_first_after_a_resume(
    dataset: PromptDataset,
) -> None:
    """A group whose row was drawn but had not come back when the checkpoint was taken is
    in no buffer: the resumed run draws that row again, then goes on in the same order."""
    first = prompts(dataset, "exact_match")
    drawn = [first.next() for _ in range(4)]
    first.settle(drawn[1])  # came back (buffered): in the checkpoint's buffer
    state = first.state_dict()
    uninterrupted = [first.next().index for _ in range(3)]

    resumed = prompts(dataset, "exact_match")
    resumed.load_state_dict(state)
    again = [resumed.next().index for _ in range(3 + 3)]
    assert again[:3] == [drawn[0].index, drawn[2].index, drawn[3].index]
    assert again[3:] == uninterrupted
    with pytest.raises(ValueError, match="no data position"):
        prompts(dataset, "exact_match").load_state_dict({"prompts_used": 3})


def cfg(**rollout: Any) -> PipelineConfig:
    return convert(
        {
            "id": "p",
            "model": {"path": "m"},
            "data": {"train": "t.jsonl"},
            "env": {"reward": "unused"},
            "rollout": {"groups_per_step": 1, "group_size": 3, **rollout},
            "clusters": {"actor_train": {"devices": [0]}, "actor_infer": {"devices": [0]}},
        },
        PipelineConfig,
        "t",
    )


def collector(tmp_path: Path, dataset: PromptDataset, reward: Any, **rollout: Any) -> Collector:
    ledger = Ledger(tmp_path / "ledger.jsonl", fresh=True, from_step=0, buffered=[])
    return Collector(
        cfg(**rollout),
        ReplayBuffer(StalenessBound(1)),
        None,
        lambda: 0,
        ledger,
        prompts(dataset, reward),  # type: ignore[arg-type]
    )


async def add(col: Collector, texts: tuple[str, ...], gid: str) -> bool:
    """A group of ``texts`` answers to the collector's next prompt, back from the router."""
    col.ledger.requested(gid, len(texts), 0)  # type: ignore[union-attr]
    return await col._add(col.prompts.next(), answers(tiny_tokenizer(), *texts), gid)


def answers(tokenizer: Any, *texts: str) -> list[Trajectory]:
    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        out.append(Trajectory([1], ids, [-0.5] * len(ids), [0] * len(ids)))
    return out


async def test_a_response_whose_reward_failed_is_left_out_of_its_group(
    tmp_path: Path, dataset: PromptDataset
) -> None:
    def reward(prompt: str, response: str, row: dict[str, Any]) -> float:
        if response == "boom":
            raise ValueError("verifier crashed")
        return float(response == str(row["answer"]))

    col = collector(tmp_path, dataset, reward)
    first = col.prompts.order.next()  # type: ignore[union-attr]  # peek: drawn again below
    col.prompts.replay = [first]  # type: ignore[union-attr]
    right = str(dataset.prompts[first].row["answer"])
    assert await add(col, (right, "boom", "7x"), "g1")
    assert col.reward_failed == 1
    (group,) = col.buffer.groups
    assert group.rewards == [1.0, 0.0] and group.response_texts == [right, "7x"]
    # two failures of three: one answer left, nothing to compare: discarded, counted
    assert not await add(col, ("boom", "boom", "1"), "g2")
    assert col.reward_failed == 3 and len(col.buffer.groups) == 1
    col.ledger.close()  # type: ignore[union-attr]
    t = tally(tmp_path / "ledger.jsonl")
    assert (t.failed, t.discarded) == (3, 1)


async def test_groups_that_score_alike_are_filtered_then_trained_when_nothing_else_comes(
    tmp_path: Path, dataset: PromptDataset
) -> None:
    col = collector(tmp_path, dataset, "exact_match", drop_uniform_groups=True)
    assert await add(col, ("no", "no", "maybe"), "g0") is False  # all 0: filtered
    col.uniform_in_a_row = 0
    limit = UNIFORM_LIMIT * col.cfg.rollout.groups_per_step
    for i in range(limit):  # every answer wrong: no gradient, resampled
        assert not await add(col, ("no", "no", "no"), f"f{i}")
    assert col.filtered == 3 * (limit + 1) and len(col.buffer.groups) == 0
    # past the limit: trained on rather than resampled forever
    assert await add(col, ("no", "no", "no"), "last")
    assert len(col.buffer.groups) == 1 and col.uniform_in_a_row == 0
    col.ledger.close()  # type: ignore[union-attr]
    t = tally(tmp_path / "ledger.jsonl")
    assert t.filtered == 3 * (limit + 1) and t.lost == 0


def test_evaluations_come_every_n_steps_and_at_the_last() -> None:
    from rlix_async.rollout.evaluate import eval_due

    assert [s for s in range(0, 13) if eval_due(s, 5, last=12)] == [0, 5, 10, 12]
    assert [s for s in range(0, 11) if eval_due(s, 5, last=10)] == [0, 5, 10]
    assert not any(eval_due(s, 0, last=12) for s in range(0, 13))  # 0: never


class _Broken:
    """An env whose every step raises."""

    def __init__(self, row: dict[str, Any]) -> None:
        pass

    async def reset(self) -> str:
        return "q"

    async def step(self, action: str) -> Any:
        raise KeyError("no such tool")


async def test_an_episode_pipeline_whose_groups_keep_failing_stops_naming_the_first(
    tmp_path: Path, dataset: PromptDataset
) -> None:
    """The issue's pipeline requested 780 groups in 7 minutes and trained nothing: after
    ``fail_after_groups`` groups in a row without one good episode the collector stops
    with one line naming the first failure; a group with one good episode resets it."""
    import msgspec
    from helpers.episodes import CHAT, decode, scripted_generate

    from rlix_async.rollout.collector import EpisodesFailing
    from rlix_async.rollout.episodes import EnvFailure, EpisodeRunner, load_env

    col = collector(tmp_path, dataset, "exact_match")
    env = msgspec.structs.replace(col.cfg.env, fail_after_groups=3)
    col.cfg = msgspec.structs.replace(col.cfg, env=env)
    runner = EpisodeRunner(load_env(f"{__name__}:_Broken"), CHAT, decode, max_turns=2,
                           max_tokens=4, max_episode_tokens=64, step_timeout_s=2.0)  # fmt: skip
    col.episodes = runner

    async def failed_group(gid: str) -> list[Any]:
        col.ledger.requested(gid, 3, 0)  # type: ignore[union-attr]
        out: list[Any] = []
        for _ in range(3):
            try:
                await runner.run({"q": 1}, scripted_generate(["a"], []))
            except EnvFailure as exc:
                out.append(exc)
        return out

    for gid in ("a", "b"):
        await col._add(col.prompts.next(), await failed_group(gid), gid)
    assert col.fatal is None
    # one good answer among failures: not a failing group
    col.ledger.requested("ok", 3, 0)  # type: ignore[union-attr]
    mixed = [*(await failed_group("x"))[:2], *answers(tiny_tokenizer(), "1")]
    await col._add(col.prompts.next(), mixed, "ok")
    assert col.failing_groups == 0
    for gid in ("c", "d", "e"):
        await col._add(col.prompts.next(), await failed_group(gid), gid)
    assert isinstance(col.fatal, EpisodesFailing)
    line = str(col.fatal)
    assert "3 groups in a row without one good episode" in line
    assert "step() raised KeyError: 'no such tool'" in line and "\n" not in line
    with pytest.raises(EpisodesFailing):
        await col.run()
    runner.close()
    col.ledger.close()  # type: ignore[union-attr]


def test_a_recipe_prepares_its_episode_runners_before_the_pipeline_joins(
    dataset: PromptDataset,
) -> None:
    """The pipeline calls Recipe.prepare() before its event loop starts: an agent
    endpoint's tool-call parser imports vLLM there, where a missed heartbeat costs
    nothing. An engine that cannot give the parser is a one-line recipe error. The
    runners are stand-ins with the one method under test (a real ApiAgentRunner needs
    a model directory and an engine's parser: tests/integration/test_agent_api_launch.py)."""
    from rlix_async.rollout.prompts import Recipe, RecipeError
    from rlix_async.shards.engines import EngineUnavailable

    class Runner:
        def __init__(self, fails: bool = False) -> None:
            self.prepared, self.fails = 0, fails

        def prepare(self) -> None:
            if self.fails:
                raise EngineUnavailable("vLLM's tool parsers do not import here: no vllm")
            self.prepared += 1

    rollout, evaluation = Runner(), Runner()
    recipe = Recipe(None, dataset, None, None, [], None, rollout, evaluation)  # type: ignore[arg-type]
    recipe.prepare()
    assert (rollout.prepared, evaluation.prepared) == (1, 1)
    broken = Recipe(None, dataset, None, None, [], None, Runner(fails=True))  # type: ignore[arg-type]
    with pytest.raises(RecipeError, match="do not import here"):
        broken.prepare()


class _Starved:
    """An env whose reset fails on a row's first try (a passing fault, as an agent's
    own-time limit overrun on starved cores is) and on every try for answer 10 (a row
    the model's answer always breaks); it rewards the answer "7"."""

    tries: dict[int, int] = {}

    def __init__(self, row: dict[str, Any]) -> None:
        self.answer = int(row["answer"])

    async def reset(self) -> str:
        n = _Starved.tries[self.answer] = _Starved.tries.get(self.answer, 0) + 1
        if self.answer == 10 or (self.answer <= 5 and n == 1):
            raise TimeoutError("more than 10 s of its own")
        return "q"

    async def step(self, action: str) -> Any:
        from rlix_async.rollout.episodes import StepResult

        return StepResult(None, 1.0 if action.strip() == "7" else 0.0, True)


@pytest.mark.parametrize("retries", [2, 0])
async def test_an_eval_asks_a_failed_prompt_again_and_scores_only_what_fails_every_try(
    dataset: PromptDataset, retries: int
) -> None:
    """The pair bench's agent scored 0.250 instead of 0.425 at step 0 because episodes
    that overran their own-time limit on cores starved by the other pipeline's start
    were scored wrong. Greedy decoding makes a retry give the answer the first try
    would have, so a failed prompt is asked again after its pass (eval/retried), and
    only one that fails every try scores 0 (eval/failed). retries=0 is the old rule.
    The cluster is a stand-in (progress recorded, generate answering "7"): what is
    under test is the evaluator's bookkeeping; the real path is test_env_recipe.py."""
    from types import SimpleNamespace

    from helpers.episodes import CHAT, decode, ids

    from rlix_async.rollout.episodes import EpisodeRunner, load_env
    from rlix_async.rollout.evaluate import Evaluator

    _Starved.tries.clear()
    progress: list[tuple[int, int]] = []

    async def report_progress(total: int, done: int, stream: str, force: bool = False) -> None:
        progress.append((total, done))

    async def clear_progress(stream: str) -> None:
        pass

    async def generate(prompt_ids: list[int], sampling: Any, **_: Any) -> Trajectory:
        out = ids("7")
        return Trajectory(list(prompt_ids), out, [-1.0] * len(out), [4] * len(out))

    client = SimpleNamespace(report_progress=report_progress, clear_progress=clear_progress)
    hooks: Any = SimpleNamespace(client=client, router=SimpleNamespace(generate=generate))
    runner = EpisodeRunner(load_env(f"{__name__}:_Starved"), CHAT, decode, max_turns=1,
                           max_tokens=4, max_episode_tokens=64, step_timeout_s=2.0)  # fmt: skip
    evaluator = Evaluator(
        prompts(dataset, "exact_match"), hooks, max_tokens=4, episodes=runner, retries=retries
    )
    row = await evaluator.run(4)
    runner.close()
    assert row["eval/n"] == 10
    if retries:  # answers 1-5 failed once, answer 10 every time (three tries)
        assert (row["eval/failed"], row["eval/retried"]) == (1, 5 + 1 + 1)
        assert row["eval/reward"] == pytest.approx(9 / 10)
    else:
        assert (row["eval/failed"], row["eval/retried"]) == (6, 0)
        assert row["eval/reward"] == pytest.approx(4 / 10)
    assert _Starved.tries[10] == retries + 1 and _Starved.tries[1] == min(2, retries + 1)
    # the planner's stream: every prompt answered or given up on once, never counted twice
    assert progress[0] == (10, 0) and progress[-1] == (10, 10)
    assert [d for _, d in progress[1:]] == list(range(1, 11))
