"""Your own agent loop: ``agent: "file.py:function"``, for what an env's reset/step
does not fit (several tools per turn, your own prompt format, a scaffold of your own).

::

    async def solve(row: dict, llm: AgentClient, **agent_args) -> float:
        chat = llm.start(row["question"])     # the first turn: text, messages or token ids
        text = await chat.generate()          # the model's turn: sampled, kept with log-probs
        chat.add(f"<result>{run(text)}</result>")   # a reply: rendered as a continuation
        text = await chat.generate()
        return 1.0 if "42" in text else 0.0   # the episode's reward

The conversation owns the token ids exactly as ``EpisodeRunner`` does (the model's
tokens mask 1, everything added mask 0, nothing re-rendered), and its limits are the
pipeline's: ``max_turns``, ``max_episode_tokens``, the engine's context and
``rollout.max_tokens`` per turn. A ``generate`` past a limit raises
:class:`EpisodeOver`; uncaught, it ends the episode with ``chat.reward`` (0 unless
the agent set it). The agent's own time between model turns is bounded by
``env_step_timeout_s`` (checked as it runs: a blocking stretch of its own cannot be
interrupted, only failed once it yields); an agent that raises, overruns or returns a
non-number fails its episode only (counted; the first logged with its row and
traceback). A request that fails in the router fails the episode as any request
does. One ``generate`` at a time.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.chat import ChatError, ChatTurns, Messages
from rlix_async.rollout.episodes import (
    EnvError,
    EnvFailure,
    Episode,
    EpisodeRunner,
    Generate,
    load_user_object,
    with_budget,
)
from rlix_async.user_code import await_guarded


class Paced(Protocol):
    """Whether a model turn is being sampled, and since when the agent has been on its own."""

    generating: bool
    idle_since: float


class EpisodeOver(Exception):
    """A limit ended the episode: no more model turns."""


class _GenerateFailed(Exception):
    """The router's error inside an agent's ``generate``: raised again as itself, so it
    counts as a failed request (as in any pipeline), not as the agent's failure."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(frozen=True)
class Agent:
    fn: Callable[..., Any]
    args: dict[str, Any]
    name: str


def load_agent(spec: str, agent_args: dict[str, Any] | None = None, client: str = "llm") -> Agent:
    """The ``async def`` function ``spec`` names, callable as ``fn(row, llm, **agent_args)``
    (``client``: what the error calls its second argument)."""
    args = dict(agent_args or {})
    fn = load_user_object(spec, "agent")
    if not inspect.iscoroutinefunction(fn):
        raise EnvError(f"agent {spec!r} must be an async def function")
    try:
        inspect.signature(fn).bind({}, None, **args)
    except TypeError as exc:
        named = f", {', '.join(args)}" if args else ""
        raise EnvError(
            f"agent {spec!r}: cannot be called as fn(row, {client}{named}): {exc}"
        ) from None
    return Agent(fn, args, spec)


class Conversation:
    """One episode's token ids, a turn at a time."""

    def __init__(self, llm: AgentClient, prompt_ids: list[int]) -> None:
        self.llm = llm
        self.episode = Episode(prompt_ids)
        self.reward = 0.0  # the episode's, if a limit ends it before the agent returns
        self._last: list[int] = []  # the model's last turn (where a reply closes it)

    async def generate(self, max_tokens: int | None = None) -> str:
        """The model's next turn, as text; EpisodeOver once a limit leaves no room."""
        llm, episode = self.llm, self.episode
        runner = llm.runner
        if llm.closed:
            raise RuntimeError("the episode is over: generate() after it ended")
        if llm.generating:  # two turns sampled from one prefix would both be trained on
            raise RuntimeError("one model turn at a time: generate() while one runs")
        if episode.turns >= runner.max_turns:
            episode.cut = "max_turns"
            raise EpisodeOver("max_turns")
        budget = runner.budget(episode)
        if max_tokens is not None:
            budget = min(budget, max_tokens)
        if budget <= 0:
            episode.cut = "max_episode_tokens"
            raise EpisodeOver("max_episode_tokens")
        llm.generating = True
        try:
            turn = await llm.generate(
                episode.prompt_ids + episode.token_ids,
                with_budget(llm.sampling, budget),
                min_version=llm.min_version,
            )
        except Exception as exc:
            raise _GenerateFailed(exc) from exc
        finally:
            llm.generating = False
            llm.idle_since = time.monotonic()
        episode.add_turn(turn)
        self._last = turn.token_ids
        return runner.decode(turn.token_ids)

    def add(self, turn: str | Messages | None) -> None:
        """A reply after the model's turn (a user message, or your messages), rendered
        with the chat template as a continuation; never trained on."""
        self.add_ids(self.llm.runner.chat.reply(turn, self._last))

    def add_ids(self, ids: list[int]) -> None:
        """Token ids of your own after the model's turn; never trained on."""
        self.episode.add(list(ids), model=False)


class AgentClient:
    """What an agent function gets: the tokenizer, and ``start`` for its conversation."""

    def __init__(
        self,
        runner: AgentRunner,
        generate: Generate,
        sampling: Sampling | None,
        min_version: int | None,
    ) -> None:
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.generate = generate
        self.sampling = sampling
        self.min_version = min_version
        self.conversation: Conversation | None = None
        self.generating = False
        self.closed = False  # the episode ended: generate() refuses
        self.idle_since = time.monotonic()

    def start(self, first: str | Messages | list[int]) -> Conversation:
        """The episode's conversation from its first turn (rendered with the chat
        template and the generation prompt; token ids are taken as they are)."""
        if self.conversation is not None:
            raise RuntimeError("an episode has one conversation: start() was called twice")
        if isinstance(first, list) and all(isinstance(t, int) for t in first):
            ids = [t for t in first if isinstance(t, int)]  # token ids, taken as they are
        else:
            ids = self.runner.chat.first(first)  # type: ignore[arg-type]
        self.conversation = Conversation(self, ids)
        return self.conversation


class AgentRunner(EpisodeRunner):
    """Runs an agent function's episodes (the env runner's limits and failure counts)."""

    def __init__(self, agent: Agent, chat: ChatTurns, tokenizer: Any, **limits: Any) -> None:
        super().__init__(
            None,  # no env: the agent is the loop
            chat,
            lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
            **limits,
        )
        self.agent = agent
        self.tokenizer = tokenizer
        self.name = f"agent {agent.name}"

    def budget(self, episode: Episode) -> int:
        return self._budget(episode)

    async def run(
        self,
        row: dict[str, Any],
        generate: Generate,
        sampling: Sampling | None = None,
        min_version: int | None = None,
    ) -> Episode:
        llm = AgentClient(self, generate, sampling, min_version)
        task = asyncio.ensure_future(await_guarded(self.agent.fn(row, llm, **self.agent.args)))
        # whatever it ends with is read here or below: never "exception never retrieved"
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            result = await self._watch(task, llm)
        except (EnvFailure, ChatError) as exc:
            failure = exc if isinstance(exc, EnvFailure) else EnvFailure(f"{self.name}: {exc}")
            self._failed(failure, row)
            raise failure from None
        finally:
            llm.closed = True  # an agent that swallows the cancel cannot go on sampling
            task.cancel()
        conversation = llm.conversation
        if conversation is None or not conversation.episode.turns:
            failure = EnvFailure(f"{self.name}: returned without a model turn")
            self._failed(failure, row)
            raise failure
        episode = conversation.episode
        episode.reward = conversation.reward if result is None else result
        return episode

    async def _watch(self, task: asyncio.Future[Any], llm: Paced) -> Any:
        """The agent's result; its own time between model turns bounded."""
        while True:
            idle_left = self.step_timeout_s - (time.monotonic() - llm.idle_since)
            wait = self.step_timeout_s if llm.generating else max(idle_left, 0.0)
            done, _ = await asyncio.wait({task}, timeout=wait)
            if done:
                break
            idle = time.monotonic() - llm.idle_since
            if not llm.generating and idle >= self.step_timeout_s and not task.done():
                raise EnvFailure(
                    f"{self.name}: more than {self.step_timeout_s:g} s of its own "
                    "between model turns"
                )
        try:
            result = task.result()
        except EpisodeOver:
            return None  # a limit ended it: the conversation's reward stands
        except _GenerateFailed as exc:
            raise exc.error from None  # the request failed, as any pipeline's can
        except Exception as exc:
            raise EnvFailure(f"{self.name}: raised {type(exc).__name__}: {exc}") from exc
        return self._reward(result)

    def _reward(self, result: Any) -> float | None:
        """What the agent returned, as the episode's reward (None: it returned None)."""
        ok = result is None or (
            isinstance(result, numbers.Real)
            and not isinstance(result, bool)
            and math.isfinite(float(result))
        )
        if not ok:
            raise EnvFailure(
                f"{self.name}: returned {type(result).__name__} {str(result)[:200]!r}; "
                "expected the episode's reward (a finite number)"
            )
        return None if result is None else float(result)
