"""Agents written against the OpenAI API: ``agent_api: "file.py:function"``.

::

    async def solve(row: dict, client: openai.AsyncOpenAI, **agent_args) -> float:
        messages = [{"role": "user", "content": row["question"]}]
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=TOOLS)
        ...                                   # run its tool calls, append, ask again
        return 1.0 if solved else 0.0         # or {"reward": 1.0, "my_metric": 3}

Each episode gets its own key for the pipeline's server (``rollout/openai_server.py``),
which routes its requests through the pipeline's router: shrinks, resumes and the
staleness bound apply, and a request cut by a shrink just takes longer. A process the
agent starts gets the episode's ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``.

The server's side of each episode (token-exact bookkeeping, limits, tools) is
``rollout/api_episode.py``. Limits are the pipeline's: a request past one gets a 400;
an agent that lets that error end its loop ends its episode as a limit would end an
env's (trained, its reward 0, cut counted); one that raises anything else, overruns
``env_step_timeout_s`` of its own between requests, or returns no number fails its
episode only.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import subprocess
from typing import Any

import openai

from rlix_async.protocols.engine import ToolCallFormat
from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.agents import Agent, AgentRunner
from rlix_async.rollout.api_episode import ApiEpisode
from rlix_async.rollout.chat import ChatTurns
from rlix_async.rollout.episodes import EnvFailure, Episode, Generate, finite_numbers
from rlix_async.rollout.openai_server import ApiServer
from rlix_async.shards.engines import EngineUnavailable
from rlix_async.shards.tool_calls import HermesToolCalls
from rlix_async.user_code import await_guarded

# the episode's OPENAI_BASE_URL and OPENAI_API_KEY, in its agent's task and what it runs
_EPISODE_ENV: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "rlix_episode_env", default=None
)


def _subprocesses_get_the_episode_env() -> None:
    """Every ``subprocess.Popen`` started from an agent_api episode's task (directly,
    through asyncio's subprocesses or a thread it started) gets the episode's
    ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY`` in its environment, so an agent that
    runs a tool or a whole harness in a child process hands it its endpoint; nothing
    else in the driver sees them (``os.environ`` is left alone: episodes run at once)."""
    if getattr(subprocess.Popen, "_rlix_episode_env", False):
        return
    original = subprocess.Popen.__init__

    def __init__(self: subprocess.Popen[Any], *args: Any, **kwargs: Any) -> None:
        extra = _EPISODE_ENV.get()
        if extra and len(args) < 10:  # env given by keyword, or not at all
            base = os.environ if kwargs.get("env") is None else kwargs["env"]
            kwargs["env"] = {**base, **extra}
        original(self, *args, **kwargs)

    subprocess.Popen.__init__ = __init__  # type: ignore[method-assign]
    subprocess.Popen._rlix_episode_env = True  # type: ignore[attr-defined]


class ApiAgentRunner(AgentRunner):
    """Runs ``agent_api`` episodes: each the agent function with an ``openai.AsyncOpenAI``
    client of its own key on the pipeline's server (started at the first episode)."""

    def __init__(
        self,
        agent: Agent,
        chat: ChatTurns,
        tokenizer: Any,
        *,
        host: str,
        model_name: str,
        tool_calls: ToolCallFormat | None = None,
        **limits: Any,
    ) -> None:
        """``tool_calls``: the serving engine's tool-call format (its backend's,
        shards/engines.py; the pipeline passes it). Unset: the Hermes format."""
        super().__init__(agent, chat, tokenizer, **limits)
        self.name = f"agent_api {agent.name}"
        self.host = host
        self.tool_calls = tool_calls or HermesToolCalls(tokenizer)
        self.model_name = model_name
        self.server: ApiServer | None = None  # once started
        self._starting: asyncio.Future[None] | None = None
        for name in ("httpx", "httpx2"):  # the openai client's: a line per request
            logging.getLogger(name).setLevel(logging.WARNING)

    async def start(self) -> ApiServer:
        """The server, started by the first episode (the ones starting beside it wait)."""
        if self._starting is None:
            server = ApiServer(self.host, self.model_name)
            self._starting = asyncio.ensure_future(self._start(server))
            self.server = server
        await asyncio.shield(self._starting)
        assert self.server is not None
        return self.server

    def prepare(self) -> None:
        """The engine's parser, which may import its library (vLLM's: 2.5 s alone, 14 s
        on 2 loaded cores): the pipeline calls this before its event loop joins the
        cluster. In a thread beside the loop the import still held the GIL for seconds,
        so heartbeats went missing and an agent's turn was timed out."""
        self.tool_calls.prepare()

    async def _start(self, server: ApiServer) -> None:
        # a library user who never called prepare(): off the loop at least
        await asyncio.to_thread(self.tool_calls.prepare)
        await server.start()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        super().close()

    async def run(
        self,
        row: dict[str, Any],
        generate: Generate,
        sampling: Sampling | None = None,
        min_version: int | None = None,
    ) -> Episode:
        try:
            server = await self.start()
        except OSError as exc:  # env.api_host is no address of this machine's, ...
            failure = EnvFailure(f"{self.name}: its server cannot listen on {self.host}: {exc}")
            self._failed(failure, row)
            raise failure from None
        except EngineUnavailable as exc:  # the parser cannot read this model's calls
            failure = EnvFailure(f"{self.name}: {exc}")
            self._failed(failure, row)
            raise failure from None
        key, name = server.new_key()
        episode = ApiEpisode(
            self, generate, sampling, min_version, name, self.model_name, self.tool_calls
        )
        task: asyncio.Future[Any] | None = None
        client = None
        result: Any = None
        try:
            server.open(key, episode)
            # one client per episode: its key is the episode's; retries would re-send a
            # request the server refused on purpose (a limit)
            client = openai.AsyncOpenAI(
                base_url=server.url, api_key=key, max_retries=0, timeout=3600.0
            )
            _subprocesses_get_the_episode_env()
            context = contextvars.copy_context()
            context.run(_EPISODE_ENV.set, {"OPENAI_BASE_URL": server.url, "OPENAI_API_KEY": key})
            task = asyncio.get_running_loop().create_task(
                await_guarded(self.agent.fn(row, client, **self.agent.args)), context=context
            )
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            result = await self._watch(task, episode)
        except EnvFailure as exc:
            limit_ended = episode.cut and isinstance(exc.__cause__, openai.BadRequestError)
            if episode.failure is not None:
                raise episode.failure from None  # the router's: a failed request
            if not limit_ended:
                self._failed(exc, row)
                raise
            result = 0.0
        finally:
            server.close_key(key)
            episode.closed = True
            if episode.pending is not None:  # a turn still sampled for it: stop decoding
                episode.pending.cancel()
            if task is not None:
                task.cancel()
            if client is not None:
                await client.close()
        if episode.failure is not None:
            raise episode.failure
        if episode.current is None or not episode.turns:
            why = (
                f"its first request was refused: {episode.refusal}"
                if episode.refusal
                else ("returned without a model turn")
            )
            failure = EnvFailure(f"{self.name}: {why}")
            self._failed(failure, row)
            raise failure
        reward, info = self._outcome(result)
        return episode.finish(reward, info)

    def _reward(self, result: Any) -> Any:
        """A number, or a dict with a number ``reward`` and numeric metrics."""
        if isinstance(result, dict):
            super()._reward(result.get("reward"))
            if result.get("reward") is None:
                raise EnvFailure(f"{self.name}: returned a dict without 'reward'")
            return result
        return super()._reward(result)

    @staticmethod
    def _outcome(result: Any) -> tuple[float, dict[str, float]]:
        """The episode's reward and its metrics (the numbers beside ``reward``, as an
        env's step ``info``)."""
        if isinstance(result, dict):
            metrics = finite_numbers({k: v for k, v in result.items() if k != "reward"})
            return float(result["reward"]), metrics
        return (0.0 if result is None else float(result)), {}
