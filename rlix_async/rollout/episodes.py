"""Multi-turn episodes: an environment's turns, generated through the router.

A pipeline names its environment as ``env: "package.module:Class"`` or
``"path/to/file.py:Class"`` with ``env_args: {...}``; one instance per episode::

    class MyEnv:
        def __init__(self, row: dict, **env_args): ...
        async def reset(self) -> str | list[dict]           # the first user turn
        async def step(self, action: str) -> StepResult    # action: the model's turn as text
        async def close(self) -> None                      # optional

Plain (non-async) methods run in threads, off the event loop. An episode: the
first turn rendered with the chat template, then per turn one router ``generate``
over the episode's ids so far (a shrink mid-turn resumes that turn elsewhere from
its partial output, as a single-turn request does); the model's tokens carry their
log-probs, weight versions and mask 1; the environment's reply is rendered as a
continuation (``rollout/chat.py``) and appended with mask 0, never trained on. It
ends on ``done``, ``max_turns`` or ``max_episode_tokens``. Its reward is the sum of
the step rewards, or the last (``episode_reward``).

An environment that raises, times out (``env_step_timeout_s``) or returns the wrong
type fails its episode only: :class:`EnvFailure`, counted; the first is logged
with its row and traceback.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import logging
import math
import numbers
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.chat import ChatError, ChatTurns, Messages
from rlix_async.rollout.env_workers import EnvProcesses, RemoteEnv
from rlix_async.rollout.threads import BoundedThreads, NoFreeThread
from rlix_async.shards.router import Trajectory
from rlix_async.user_code import LoadError, await_guarded, call_guarded, load_object

log = logging.getLogger("rlix_async.episodes")
ROW_REPR_LIMIT = 300


@dataclass(frozen=True)
class StepResult:
    """What an environment's ``step`` returns."""

    observation: str | Messages | None  # the environment's reply (None: no message)
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class EnvError(ValueError):
    """An environment that cannot be used (does not load, wrong shape): one line."""


class EnvFailure(RuntimeError):
    """One episode's environment raised, timed out or returned the wrong type."""


@dataclass(frozen=True)
class Env:
    """A loaded environment class and its arguments."""

    cls: type
    args: dict[str, Any]
    name: str

    def make(self, row: dict[str, Any]) -> Any:
        return self.cls(row, **self.args)


def load_user_object(spec: str, what: str) -> Any:
    """The object ``spec`` names (``rlix_async.user_code``); EnvError (one line) if it does
    not load, a module failing while it imports included."""
    try:
        return load_object(spec)
    except LoadError as exc:
        raise EnvError(f"cannot load {what}: {' '.join(str(exc).split())}") from None
    except Exception as exc:
        raise EnvError(f"cannot load {what} {spec!r}: {type(exc).__name__}: {exc}") from None


def load_env(spec: str, env_args: dict[str, Any] | None = None) -> Env:
    """The class ``spec`` names, checked to have ``reset`` and ``step`` and to be
    constructible as ``Class(row, **env_args)``; EnvError (one line) otherwise."""
    args = dict(env_args or {})
    cls = load_user_object(spec, "env")
    if not isinstance(cls, type):
        raise EnvError(f"env {spec!r} is a {type(cls).__name__}, not a class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise EnvError(f"env {spec!r}: {cls.__name__} has no {' or '.join(missing)}() method")
    try:
        inspect.signature(cls).bind({}, **args)
    except TypeError as exc:
        named = f", {', '.join(args)}" if args else ""
        raise EnvError(
            f"env {spec!r}: cannot be built as {cls.__name__}(row{named}): {exc}"
        ) from None
    except ValueError:
        pass  # no signature to check (a C type): it fails at run time instead
    return Env(cls, args, spec)


@dataclass
class Episode(Trajectory):
    """A trajectory of several turns: ``token_ids`` holds every token after the first
    prompt, the model's (mask 1) and the environment's (mask 0)."""

    mask: list[int] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    env_s: float = 0.0
    cut: str = ""  # "" (done), "max_turns" or "max_episode_tokens"
    info: dict[str, float] = field(default_factory=dict)  # the last step's numeric info
    # agent_api (rollout/api_agents.py): trajectories of the same episode split off
    # before this one (the agent rewrote its history), trained with its reward, and
    # how many splits there were
    segments: list[Episode] = field(default_factory=list)
    splits: int = 0

    def add(
        self,
        ids: list[int],
        *,
        model: bool,
        logprobs: list[float] | None = None,
        versions: list[int | None] | None = None,
    ) -> None:
        self.token_ids += ids
        self.mask += [int(model)] * len(ids)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        # an environment token is as old as the turn it answers: staleness counts from
        # the episode's oldest model token either way
        last = next((v for v in reversed(self.versions) if v is not None), None)
        self.versions += versions if versions is not None else [last] * len(ids)

    def add_turn(self, turn: Trajectory) -> None:
        """The model's answer to this turn: its tokens, and what serving it took."""
        self.add(turn.token_ids, model=True, logprobs=turn.logprobs, versions=turn.versions)
        self.resumes += turn.resumes
        self.served_s += turn.served_s
        self.ranks += turn.ranks
        self.turns += 1

    def figures(self) -> dict[str, float]:
        model = sum(self.mask)
        return {
            **{f"info/{k}": v for k, v in self.info.items()},
            "turns": float(self.turns),
            "env_s": self.env_s,
            "model_tokens": float(model),
            "env_tokens": float(len(self.mask) - model),
            "cut_turns": float(self.cut == "max_turns"),
            "cut_tokens": float(self.cut == "max_episode_tokens"),
            "api_splits": float(self.splits),
        }


Generate = Callable[..., Awaitable[Trajectory]]


class EpisodeRunner:
    """Runs episodes of one environment for a pipeline's collector or evaluator."""

    def __init__(
        self,
        env: Env | None,
        chat: ChatTurns,
        decode: Callable[[list[int]], str],
        *,
        max_turns: int,
        max_tokens: int,
        max_episode_tokens: int,
        step_timeout_s: float,
        reward: str = "sum",
        context_tokens: int | None = None,
        max_threads: int = 8,
        processes: EnvProcesses | None = None,
    ) -> None:
        self.env = env  # None: an agent function runs the loop (rollout/agents.py)
        self.name = f"env {env.name}" if env is not None else ""
        self.chat = chat
        self.decode = decode
        self.max_turns = max_turns
        self.max_tokens = max_tokens  # per model turn
        self.max_episode_tokens = max_episode_tokens
        self.step_timeout_s = step_timeout_s
        self.reward = reward
        self.context_tokens = context_tokens  # the engine's max_model_len, when known
        self.failures = 0
        self.first_failure = ""  # the first failure's line (a pipeline stopping names it)
        # plain env methods run in threads of their own: never in the loop's default pool,
        # which the trainer's steps and checkpoints use (a stuck env would stall training)
        self._threads = BoundedThreads(max_threads, "env")  # a call's clock starts with its thread
        self.processes = processes  # env_workers: each episode's env in a worker process

    @property
    def stuck(self) -> int:
        """Env calls that timed out and still hold a thread (a worker process's are
        stopped with it: rollout/env_workers.py)."""
        return self._threads.stuck

    def prepare(self) -> None:
        """What the runner loads before the pipeline joins its cluster (nothing here)."""

    def close(self) -> None:
        """Shut the env threads (and workers) down without waiting for calls still running."""
        self._threads.close()
        if self.processes is not None:
            self.processes.close()

    async def run(
        self,
        row: dict[str, Any],
        generate: Generate,
        sampling: Sampling | None = None,
        min_version: int | None = None,
    ) -> Episode:
        """One episode on ``row``; ``generate`` is the router's: each turn is sampled as
        ``sampling`` says (None: the defaults), with what is left of the episode's token
        budget as its max_tokens."""
        env = None
        clock = [0.0]  # seconds spent in the environment's methods
        busy: list[concurrent.futures.Future[Any]] = []  # the env's call still in a thread
        try:
            assert self.env is not None
            build = self.env.make
            if self.processes is not None:
                await self.processes.started()  # the clock is the env's, not Python's start
                build = self.processes.build
            env = await self._call("__init__", clock, busy, build, row)
            first = await self._call("reset", clock, busy, env.reset)
            episode = Episode(self.chat.first(first))
            rewards: list[float] = []
            episode.cut = "max_turns"
            while episode.turns < self.max_turns:
                budget = self._budget(episode)
                if budget <= 0 and not episode.turns:  # a 0 would be a verdict never given
                    raise EnvFailure(
                        f"{self.name}: the first turn ({len(episode.prompt_ids)} "
                        f"tokens) leaves no room to answer in {self.context_tokens} tokens"
                    )
                if budget <= 0:
                    episode.cut = "max_episode_tokens"
                    break
                turn = await generate(
                    episode.prompt_ids + episode.token_ids,
                    with_budget(sampling, budget),
                    min_version=min_version,
                )
                episode.add_turn(turn)
                action = self.decode(turn.token_ids)
                result = self._check(await self._call("step", clock, busy, env.step, action))
                rewards.append(float(result.reward))
                episode.info = finite_numbers(result.info)
                if result.done:
                    episode.cut = ""
                    break
                if episode.turns == self.max_turns:
                    break
                reply = self.chat.reply(result.observation, turn.token_ids)
                episode.add(reply, model=False)
                if self._budget(episode) <= 0:  # no room for the reply and a turn after it
                    del episode.token_ids[-len(reply) :], episode.mask[-len(reply) :]
                    del episode.logprobs[-len(reply) :], episode.versions[-len(reply) :]
                    episode.cut = "max_episode_tokens"
                    break
            if rewards:
                episode.reward = sum(rewards) if self.reward == "sum" else rewards[-1]
            episode.env_s = clock[0]
            return episode
        except EnvFailure as exc:
            self._failed(exc, row)
            raise
        except ChatError as exc:
            failure = EnvFailure(f"{self.name}: {exc}")
            self._failed(failure, row)
            raise failure from None
        finally:
            # never beside a call of the env's still running in its thread (a timed-out
            # step): that env is left to it
            idle = not busy or busy[-1].done()
            if isinstance(env, RemoteEnv):
                env.release()  # closed in its worker, after any call still running there
            elif env is not None and idle and callable(getattr(env, "close", None)):
                try:
                    await self._call("close", clock, busy, env.close)
                except EnvFailure as exc:
                    log.warning("%s", exc)

    def _budget(self, episode: Episode) -> int:
        budget = min(self.max_tokens, self.max_episode_tokens - len(episode.token_ids))
        if self.context_tokens is not None:
            budget = min(
                budget, self.context_tokens - len(episode.prompt_ids) - len(episode.token_ids)
            )
        return budget

    async def _call(
        self,
        what: str,
        clock: list[float],
        busy: list[concurrent.futures.Future[Any]],
        fn: Callable[..., Any],
        *args: Any,
    ) -> Any:
        """``fn(*args)`` under the step timeout: awaited if async, else in one of the
        runner's threads (the clock starts once a thread is free); its seconds are added
        to ``clock[0]``, and a thread's call to ``busy``."""
        t0 = time.monotonic()
        try:
            if inspect.iscoroutinefunction(fn):
                async with asyncio.timeout(self.step_timeout_s) as deadline:
                    return await await_guarded(fn(*args))
            try:  # bounded: timed-out calls may hold every thread
                future = await self._threads.start(
                    call_guarded, fn, *args, wait_s=self.step_timeout_s * 10
                )
            except NoFreeThread as exc:
                raise EnvFailure(f"{self.name}: {exc}") from None
            t0 = time.monotonic()
            busy.append(future)
            try:
                async with asyncio.timeout(self.step_timeout_s) as deadline:
                    result = await asyncio.shield(asyncio.wrap_future(future))
                    if inspect.isawaitable(result):  # an async method behind a decorator
                        result = await await_guarded(result)
                    return result
            finally:
                self._threads.let_go(future)  # timed out (or cancelled): its thread is held
        except TimeoutError:
            if deadline.expired():
                raise EnvFailure(
                    f"{self.name}: {what}() took longer than {self.step_timeout_s:g} s"
                ) from None
            raise EnvFailure(f"{self.name}: {what}() raised TimeoutError") from None
        except EnvFailure:
            raise
        except Exception as exc:
            raise EnvFailure(f"{self.name}: {what}() raised {type(exc).__name__}: {exc}") from exc
        finally:
            clock[0] += time.monotonic() - t0

    def _check(self, result: Any) -> StepResult:
        """A StepResult, or a gym-style tuple: (observation, reward, done[, info]) or
        gymnasium's (observation, reward, terminated, truncated, info), or a mapping or
        any object with ``observation``, ``reward``, ``done`` (and ``info``)."""
        if isinstance(result, Mapping) and {"observation", "reward", "done"} <= result.keys():
            info = result.get("info") or {}
            result = StepResult(result["observation"], result["reward"], result["done"], info)
        elif not isinstance(result, StepResult | tuple) and all(
            hasattr(result, k) for k in ("observation", "reward", "done")
        ):
            info = getattr(result, "info", None) or {}
            result = StepResult(result.observation, result.reward, result.done, info)
        if isinstance(result, tuple) and len(result) == 5:
            obs, reward, terminated, truncated, info = result
            result = StepResult(obs, reward, _flag(terminated) or _flag(truncated), info)
        elif isinstance(result, tuple) and len(result) in (3, 4):
            result = StepResult(*result)
        if isinstance(result, StepResult) and not isinstance(result.done, bool):
            done = _flag(result.done)
            result = StepResult(result.observation, result.reward, done, result.info)
        ok = (
            isinstance(result, StepResult)
            and isinstance(result.reward, numbers.Real)
            and not isinstance(result.reward, bool)
            and math.isfinite(float(result.reward))
            and isinstance(result.done, bool)
        )
        if not ok:
            raise EnvFailure(
                f"{self.name}: {type(self).__name__ if self.env is None else self.env.cls.__name__}"
                f".step() returned "
                f"{type(result).__name__} {str(result)[:200]!r}; expected "
                "StepResult(observation, reward: a finite number, done: bool, info)"
            )
        return result

    def _failed(self, exc: EnvFailure, row: dict[str, Any]) -> None:
        self.failures += 1
        if self.failures == 1:
            self.first_failure = str(exc)
            text = repr(row)
            text = text if len(text) <= ROW_REPR_LIMIT else text[:ROW_REPR_LIMIT] + "..."
            cause = exc.__cause__ or exc
            log.error(
                "%s; row: %s (later failures are counted, not logged)",
                exc,
                text,
                exc_info=(type(cause), cause, cause.__traceback__),
            )


def finite_numbers(info: Any) -> dict[str, float]:
    """The finite numbers of a step's ``info`` (logged per step as ``env/<key>`` means)."""
    if not isinstance(info, dict):
        return {}
    return {
        str(k): float(v)
        for k, v in info.items()
        if isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(float(v))
    }


def figures_of(episodes: list[Episode]) -> dict[str, list[float]]:
    """``Group.episodes`` for a group: every figure per episode (nan: an info key an
    episode's last step did not report)."""
    each = [e.figures() for e in episodes]
    names = sorted({k for f in each for k in f})
    return {k: [f.get(k, math.nan) for f in each] for k in names}


def _flag(value: Any) -> bool | Any:
    """numpy's bool as a bool; anything else as it is (the check refuses non-bools)."""
    kind = type(value)
    numpy_bool = kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")
    return bool(value) if numpy_bool else value


def episode_stats(figures: dict[str, list[float]]) -> dict[str, float]:
    """A step's episode metrics from its groups' figures (``Group.episodes``, joined)."""
    turns = sorted(figures.get("turns", []))
    if not turns:
        return {}
    n = len(turns)

    def mean(key: str) -> float:
        return sum(figures[key]) / n

    infos = {
        f"env/{k[len('info/') :]}": finite
        for k, values in figures.items()
        if k.startswith("info/") and (finite := [v for v in values if not math.isnan(v)])
    }
    return {
        **{k: sum(v) / len(v) for k, v in infos.items()},
        "turns_mean": sum(turns) / n,
        "turns_p90": turns[max(math.ceil(0.9 * n) - 1, 0)],
        "turns_max": turns[-1],
        "env_s": mean("env_s"),
        "episode_model_tokens": mean("model_tokens"),
        "episode_env_tokens": mean("env_tokens"),
        "cut_max_turns": sum(figures["cut_turns"]),
        "cut_max_episode_tokens": sum(figures["cut_tokens"]),
        **({"api_splits": sum(figures["api_splits"])} if "api_splits" in figures else {}),
    }


def turns_of(
    tokens: list[int], mask: list[int], decode: Callable[[list[int]], str]
) -> list[dict[str, str]]:
    """An episode's turns as text, in order: ``{"model": ...}`` or ``{"env": ...}``."""
    turns: list[dict[str, str]] = []
    start = 0
    for i in range(1, len(tokens) + 1):
        if i == len(tokens) or mask[i] != mask[start]:
            turns.append({"model" if mask[start] else "env": decode(tokens[start:i])})
            start = i
    return turns


@dataclass
class Packed:
    """A group's episodes as one prompt and per-episode responses (``Group``'s fields)."""

    prompt: list[int]
    responses: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    masks: list[list[int]]


def pack(episodes: list[Episode]) -> Packed:
    """A group shares one prompt: the longest one every episode starts with. An env whose
    reset differs between episodes (a random start) keeps the rest of its first turn in
    the response, masked, so every episode is trained on what its model saw."""
    prompt = list(episodes[0].prompt_ids)
    for e in episodes[1:]:
        same = next(
            (i for i, (a, b) in enumerate(zip(prompt, e.prompt_ids, strict=False)) if a != b),
            min(len(prompt), len(e.prompt_ids)),
        )
        del prompt[same:]
    packed = Packed(prompt, [], [], [], [])
    for e in episodes:
        rest = e.prompt_ids[len(prompt) :]
        first = next((v for v in e.versions if v is not None), 0)
        packed.responses.append(rest + e.token_ids)
        packed.logprobs.append([0.0] * len(rest) + e.logprobs)
        packed.versions.append([first if v is None else v for v in [None] * len(rest) + e.versions])
        packed.masks.append([0] * len(rest) + e.mask)
    return packed


def with_budget(sampling: Sampling | None, budget: int) -> Sampling:
    """A turn's sampling: the episode's, with the tokens it may still use."""
    if sampling is None:
        return Sampling(max_tokens=budget)
    return msgspec.structs.replace(sampling, max_tokens=budget)
