"""Where a pipeline's prompts come from and how its responses are scored.

Two kinds, one interface for the collector and the evaluator:

- :class:`TokenTaskPrompts`: a token-id task (``rollout/tasks.py``): random
  prompts from the vocabulary, scored on token ids. The fast test fixtures.
- :class:`TextPrompts`: a text recipe: rows of a dataset rendered with the
  model's chat template (``rollout/dataset.py``), responses decoded and scored
  by the user's reward (``rollout/rewards.py``), off the event loop.

:func:`load_recipe` builds a text recipe from a pipeline config: tokenizer,
datasets and reward, each failure a :class:`RecipeError` naming the file. The
launcher calls it before any process starts, so a missing file, a row without
the prompt key or a reward that does not import is a config error, not a crash
inside torchrun after the engines are up.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlix_async.config import PipelineConfig
from rlix_async.rollout.agents import AgentRunner, load_agent
from rlix_async.rollout.chat import ChatError, ChatTurns
from rlix_async.rollout.dataset import DataError, PromptDataset, PromptOrder
from rlix_async.rollout.env_workers import EnvProcesses
from rlix_async.rollout.episodes import EnvError, EpisodeRunner, load_env
from rlix_async.rollout.rewards import RewardError, RewardRunner, load_reward
from rlix_async.rollout.tasks import Task, make_task


class RecipeError(ValueError):
    """A text recipe that cannot run (bad data, a reward that does not load): one line."""


@dataclass(frozen=True)
class Sample:
    """One prompt to sample a group of responses for."""

    ids: list[int]
    text: str = ""  # the rendered prompt (text recipes)
    row: dict[str, Any] = field(default_factory=dict)  # the row's other fields, for the reward
    index: int = -1  # text recipes: its position in the dataset's prompts


@dataclass
class Scored:
    rewards: list[float]
    texts: list[str]  # the responses decoded ([] for token-id tasks)
    extras: dict[str, list[float]]  # the reward's named extras (nan where a response had none)
    errors: list[bool] = field(default_factory=list)  # per response: its reward failed


def truncated(tokens: list[int], max_tokens: int, stop_token_ids: list[int]) -> bool:
    """A response cut at ``max_tokens`` without reaching an end-of-sequence token."""
    ended = bool(tokens) and tokens[-1] in stop_token_ids
    return len(tokens) >= max_tokens and not ended


def finite_mean(values: list[float]) -> float:
    """The mean of the values that are numbers (an extra a response did not report is nan)."""
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan


class TokenTaskPrompts:
    """Random prompts of a token-id task; the score is a pure function of the tokens."""

    stop_token_ids: list[int] = []
    stop: list[str] = []

    def __init__(self, task: Task, seed: int) -> None:
        self.task = task
        self.rng = random.Random(seed)

    def next(self) -> Sample:
        return Sample(self.task.prompt(self.rng))

    async def score(self, sample: Sample, responses: list[list[int]]) -> Scored:
        return Scored(
            [self.task.score(sample.ids, r) for r in responses], [], {}, [False] * len(responses)
        )

    def settle(self, sample: Sample) -> None:
        """Random prompts: nothing to keep track of."""

    def state_dict(self) -> dict[str, Any]:
        return {"driver_rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.setstate(_as_rng_state(state["driver_rng"]))


class TextPrompts:
    """Rows of a dataset in a deterministic order per epoch, scored by the user's reward."""

    def __init__(
        self,
        dataset: PromptDataset,
        tokenizer: Any,
        runner: RewardRunner | None,
        *,
        order: PromptOrder | None = None,
        stop_token_ids: list[int] | None = None,
        stop: list[str] | None = None,
    ) -> None:
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.runner = runner
        self.order = order
        self.stop_token_ids = list(stop_token_ids or [])
        self.stop = list(stop or [])
        # positions (in dataset.prompts) drawn and not yet settled: a checkpoint keeps
        # them, and a resume hands them out first, so no row is skipped by a restart
        self.in_flight: list[int] = []
        self.replay: list[int] = []

    def next(self) -> Sample:
        """The next row: first those a checkpoint had in flight, then the epoch's order."""
        if self.order is None:
            raise RuntimeError("an evaluation set is read in file order, not drawn from")
        position = self.replay.pop(0) if self.replay else self.order.next()
        self.in_flight.append(position)
        return self.at(position)

    def at(self, position: int) -> Sample:
        """The dataset's prompt at ``position``, as a sample."""
        p = self.dataset.prompts[position]
        return Sample(p.ids, p.text, p.row, position)

    def settle(self, sample: Sample) -> None:
        """The sample's group came back (buffered, dropped or filtered): its row is no
        longer one a checkpoint must hand out again."""
        if sample.index in self.in_flight:
            self.in_flight.remove(sample.index)

    def env_row(self, sample: Sample) -> dict[str, Any]:
        """The sample's row as the file holds it, its prompt included (an environment's)."""
        return {self.dataset.key: self.dataset.prompts[sample.index].value, **sample.row}

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    async def score(self, sample: Sample, responses: list[list[int]]) -> Scored:
        if self.runner is None:
            raise RuntimeError("an env pipeline's episodes score themselves")
        runner = self.runner
        texts = [self.decode(r) for r in responses]
        scores = await asyncio.gather(*(runner.score(sample.text, t, sample.row) for t in texts))
        names = sorted({k for s in scores for k in s.extras})
        extras = {k: [s.extras.get(k, math.nan) for s in scores] for k in names}
        errors = [s.error is not None for s in scores]
        return Scored([s.value for s in scores], texts, extras, errors)

    def state_dict(self) -> dict[str, Any]:
        return {
            "data_order": self.order.state_dict() if self.order is not None else {},
            "data_in_flight": [*self.replay, *self.in_flight],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.order is None:
            return
        if "data_order" not in state:
            raise ValueError("the checkpoint holds no data position (a token-task run?)")
        self.order.load_state_dict(state["data_order"])
        self.replay = [int(i) for i in state.get("data_in_flight", [])]


PromptSource = TokenTaskPrompts | TextPrompts


def _as_rng_state(state: Any) -> tuple[Any, ...]:
    """random.getstate() after a round trip through a checkpoint (lists for tuples)."""
    version, internal, gauss = state
    return (version, tuple(internal), gauss)


@dataclass
class Recipe:
    """A text recipe, loaded: what rank 0's collector and evaluator use."""

    tokenizer: Any
    train: PromptDataset
    eval: PromptDataset | None
    runner: RewardRunner | None  # None: an env pipeline (its episodes score themselves)
    stop_token_ids: list[int]
    # evaluation's own threads and failure count: an evaluation never delays (or times
    # out) the rollout's rewards, and its failures are its own
    eval_runner: RewardRunner | None = None
    episodes: EpisodeRunner | None = None  # an env pipeline's (rollout/episodes.py)
    eval_episodes: EpisodeRunner | None = None

    def train_prompts(self, cfg: PipelineConfig) -> TextPrompts:
        assert cfg.data is not None
        order = PromptOrder(len(self.train), cfg.seed, shuffle=cfg.data.shuffle)
        return self._prompts(self.train, cfg, order)

    def eval_prompts(self, cfg: PipelineConfig) -> TextPrompts | None:
        if self.eval is None:
            return None
        return self._prompts(self.eval, cfg, None, self.eval_runner or self.runner)

    def _prompts(
        self,
        dataset: PromptDataset,
        cfg: PipelineConfig,
        order: PromptOrder | None,
        runner: RewardRunner | None = None,
    ) -> TextPrompts:
        return TextPrompts(
            dataset,
            self.tokenizer,
            runner or self.runner,
            order=order,
            stop_token_ids=self.stop_token_ids,
            stop=list(cfg.rollout.stop),
        )

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _runners(self) -> list[RewardRunner | EpisodeRunner]:
        both = (self.runner, self.eval_runner, self.episodes, self.eval_episodes)
        return list({id(r): r for r in both if r is not None}.values())

    def prepare(self) -> None:
        """Load what the episode runners need before the pipeline joins its cluster
        (an agent endpoint's tool-call parser). Raises RecipeError (one line)."""
        from rlix_async.shards.engines import EngineUnavailable

        for runner in (self.episodes, self.eval_episodes):
            if runner is not None:
                try:
                    runner.prepare()
                except EngineUnavailable as exc:
                    raise RecipeError(str(exc)) from None

    def close(self) -> None:
        for runner in self._runners():
            runner.close()

    @property
    def stuck(self) -> int:
        """Reward or env calls that timed out and still hold a thread."""
        return sum(r.stuck for r in self._runners())


def stop_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The ids a response ends at: the tokenizer's end of sequence and the model's
    generation config's (which may name several, e.g. an end-of-turn token too)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if (Path(model_path) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
    return sorted(ids)


def load_recipe(cfg: PipelineConfig) -> Recipe:
    """Tokenizer, datasets and reward of a text recipe; RecipeError names what is wrong."""
    data = cfg.data
    if data is None or cfg.model.path is None or not cfg.env.scorers:
        raise RecipeError(f"pipeline {cfg.id}: not a text recipe (data, model.path, env.reward)")
    model = Path(cfg.model.path)
    if not (model / "config.json").is_file():
        raise RecipeError(f"model.path: {model} is not a Hugging Face model directory")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model))
        stops = stop_token_ids(str(model), tokenizer)
    except (OSError, ValueError) as exc:
        raise RecipeError(f"model.path: {model}: no usable tokenizer ({_one_line(exc)})") from None
    if len(stops) > 64:
        raise RecipeError(f"model.path: {model}: {len(stops)} end-of-sequence ids (at most 64)")
    reward = None
    try:
        if cfg.env.reward:
            reward = load_reward(cfg.env.reward, cfg.env.reward_args)
    except RewardError as exc:
        raise RecipeError(f"env.reward: {exc}") from None
    try:
        keys = data.keys
        train = PromptDataset(
            data.train, tokenizer, max_prompt_tokens=data.max_prompt_tokens, **keys
        )
        evaluation = None
        if data.eval is not None:
            evaluation = PromptDataset(
                data.eval, tokenizer, max_prompt_tokens=data.max_prompt_tokens, **keys
            )
            if data.eval_rows is not None:
                del evaluation.prompts[data.eval_rows :]
    except DataError as exc:
        raise RecipeError(str(exc)) from None
    if reward is None:  # an env pipeline: one runner of episodes each for rollout and eval
        processes = None
        env = cfg.env
        if env.env_class is not None and env.workers:  # shared: N workers in all
            processes = EnvProcesses(env.workers, env.env_class, env.env_args)
        runs = [_episodes(cfg, tokenizer, processes) for _ in range(2 if evaluation else 1)]
        return Recipe(tokenizer, train, evaluation, None, stops, None, runs[0], runs[-1])
    runner = RewardRunner(reward, timeout_s=cfg.env.reward_timeout_s)
    eval_runner = (
        RewardRunner(reward, timeout_s=cfg.env.reward_timeout_s) if evaluation is not None else None
    )
    return Recipe(tokenizer, train, evaluation, runner, stops, eval_runner)


def _episodes(cfg: PipelineConfig, tokenizer: Any, processes: EnvProcesses | None) -> EpisodeRunner:
    """An env pipeline's runner of episodes, or an agent pipeline's."""
    e = cfg.env
    key = "env.env_class" if e.env_class else ("env.agent_api" if e.agent_api else "env.agent")
    limits: dict[str, Any] = {
        "max_turns": e.max_turns,
        "max_tokens": cfg.rollout.max_tokens,
        "max_episode_tokens": e.max_episode_tokens,
        "step_timeout_s": e.step_timeout_s,
        "reward": e.episode_reward,
        "context_tokens": cfg.max_model_len,
    }
    try:
        chat = ChatTurns(tokenizer)
        if e.env_class is not None:
            decode = lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True))  # noqa: E731
            env = load_env(e.env_class, e.env_args)
            return EpisodeRunner(env, chat, decode, processes=processes, **limits)
        if e.agent_api is not None:
            try:  # the agents extra: not needed by any other pipeline
                from rlix_async.rollout.api_agents import ApiAgentRunner
            except ImportError as exc:
                raise RecipeError(
                    f"agent_api needs {exc.name} (bash scripts/setup.sh agents)"
                ) from None
            from rlix_async.shards.engines import EngineUnavailable, engine_backend

            agent = load_agent(e.agent_api, e.agent_args, client="client")
            try:
                tools = engine_backend(cfg.engine).tool_calls(e.tool_call_parser, tokenizer)
            except EngineUnavailable as exc:
                raise RecipeError(str(exc)) from None
            host, name = e.api_host, cfg.id
            return ApiAgentRunner(
                agent, chat, tokenizer, host=host, model_name=name, tool_calls=tools, **limits
            )
        assert e.agent is not None
        return AgentRunner(load_agent(e.agent, e.agent_args), chat, tokenizer, **limits)
    except (EnvError, ChatError) as exc:
        raise RecipeError(f"{key}: {exc}") from None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]


def make_token_prompts(cfg: PipelineConfig) -> TokenTaskPrompts:
    task = cfg.token_task
    assert task is not None, "a text recipe has no token task"
    return TokenTaskPrompts(make_task(task), cfg.seed)
