"""The server's side of an ``agent_api`` episode (rollout/api_agents.py): its
trajectories, a request at a time.

Token-exact: the server keeps the episode's tokens as sampled (:class:`ApiEpisode`).
A request whose messages extend what the episode has been served (its earlier
messages, then each reply as the server returned it) reuses those tokens and renders
only the new messages, as a continuation (mask 0). A request that does not (the agent
edited, reordered or dropped history) starts a new trajectory from its messages as
rendered; the earlier one is trained as it stands with the episode's reward, its
advantage the episode's (``Group.members``), and the split is counted
(``api_splits``). Log-probs are the sampler's. A request's ``temperature`` or
``top_p`` other than the pipeline's is refused (400 naming the pipeline's): the
trainer's log-probs assume the pipeline's sampling. Every other field is honoured or
refused by name (rollout/api_fields.py).

Limits are the pipeline's: ``max_turns`` over the episode, ``max_episode_tokens`` and
the engine's context per trajectory, a request's ``max_tokens`` within them; past one
a request gets a 400. An agent that lets that error end its loop ends its episode as
a limit would end an env's (trained, its reward 0, cut counted); one that raises
anything else, overruns ``env_step_timeout_s`` of its own between requests, or
returns no number fails its episode only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec

from rlix_async.protocols.engine import ToolCallFormat
from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.agents import AgentRunner
from rlix_async.rollout.api_fields import check_fields
from rlix_async.rollout.chat import ChatError, ChatTurns
from rlix_async.rollout.episodes import Episode, Generate, with_budget
from rlix_async.rollout.openai_server import ApiError
from rlix_async.shards.tool_calls import HermesToolCalls, text_of

Messages = list[dict[str, Any]]
MAX_STOPS = 4  # OpenAI's


def _ended() -> ApiError:
    """The refusal of a request whose episode ended while it was served."""
    return ApiError(401, "this episode ended during the request", "invalid_api_key")


def _key(m: Any) -> tuple[Any, ...]:
    """What a message says (role, text, tool calls by name and arguments): two messages
    with the same key are the same turn."""
    if not isinstance(m, dict):
        return (None,)
    calls = []
    tool_calls = m.get("tool_calls") or []
    for c in tool_calls if isinstance(tool_calls, list) else [tool_calls]:
        fn = c.get("function") if isinstance(c, dict) else None
        fn = fn if isinstance(fn, dict) else {}
        args = fn.get("arguments", "")
        with contextlib.suppress(json.JSONDecodeError):
            args = json.dumps(json.loads(args), sort_keys=True) if isinstance(args, str) else args
        calls.append((fn.get("name"), repr(args)))
    try:
        content = text_of(m.get("content"))
    except ValueError:
        content = None
    return (m.get("role"), content, tuple(calls))


def _is_tool(tool: Any) -> bool:
    """A Chat Completions function tool: ``{type: function, function: {name: str,
    description?: str, parameters?: object}}``."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    return (
        isinstance(fn, dict)
        and tool.get("type", "function") == "function"
        and isinstance(fn.get("name"), str)
        and isinstance(fn.get("description", ""), str)
        and isinstance(fn.get("parameters", {}), dict)
    )


class ApiEpisode:
    """One episode's trajectories, served a request at a time."""

    def __init__(
        self,
        runner: AgentRunner,
        generate: Generate,
        sampling: Sampling | None,
        min_version: int | None,
        name: str,
        model_name: str,
        tool_calls: ToolCallFormat | None = None,
    ) -> None:
        self.runner = runner
        self.model_name = model_name
        # the serving engine's (its backend's, shards/engines.py); unset: Hermes
        self.tool_calls = tool_calls or HermesToolCalls(runner.tokenizer)
        self.generate, self.sampling, self.min_version = generate, sampling, min_version
        self.name = name  # tool call ids start with it
        self.done: list[Episode] = []  # trajectories split off, trained as they stand
        self.current: Episode | None = None
        self.served: Messages = []  # what the next request must start with to reuse it
        self.served_text: str | None = None  # /v1/completions: the same, as text
        self.tools: Any = None
        self.last_ids: list[int] = []  # the model's last turn
        self.turns = 0
        self.splits = 0
        self.cut = ""  # the limit a request was refused at
        self.refusal = ""  # and the refusal's message
        self.failure: Exception | None = None  # a request the router failed
        self.pending: asyncio.Future[Any] | None = None  # the turn being sampled
        self.generating = False
        self.closed = False
        self.idle_since = time.monotonic()

    # --- the request -----------------------------------------------------------------

    def _sampling(self, body: dict[str, Any]) -> Sampling:
        base = self.sampling or Sampling(max_tokens=1)
        for name in ("temperature", "top_p"):
            value = body.get(name)
            if value is not None and (
                not isinstance(value, int | float)
                or isinstance(value, bool)
                or value != getattr(base, name)  # exact: a huge integer never overflows
            ):
                raise ApiError(
                    400,
                    f"{name} {value!r}: this pipeline samples at temperature "
                    f"{base.temperature:g}, top_p {base.top_p:g} (rollout.temperature, "
                    "rollout.top_p); its trainer's log-probs assume them, so leave them out",
                    param=name,
                )
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else stop or []
        if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise ApiError(400, "stop must be a string or a list of strings", param="stop")
        if len(stops) > MAX_STOPS:
            raise ApiError(400, f"stop: at most {MAX_STOPS} sequences", param="stop")
        if stops:
            base = msgspec.structs.replace(base, stop=(*base.stop, *stops))
        return base

    def _budget(self, episode: Episode, body: dict[str, Any]) -> int:
        runner = self.runner
        if self.turns >= runner.max_turns:
            self.cut = "max_turns"
            raise ApiError(400, f"max_turns ({runner.max_turns}) reached: the episode is over")
        budget = runner.budget(episode)
        if budget <= 0:
            self.cut = "max_episode_tokens"
            raise ApiError(
                400,
                f"the episode's {len(episode.token_ids)} tokens leave no room to answer "
                f"(max_episode_tokens {runner.max_episode_tokens}, the engine's context "
                f"{runner.context_tokens})",
                "context_length_exceeded",
            )
        given = {
            k: body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None
        }
        if len(set(map(repr, given.values()))) > 1:
            raise ApiError(400, f"max_tokens and max_completion_tokens differ: {given}")
        name, asked = next(iter(given.items()), ("max_tokens", None))
        if asked is not None and (
            not isinstance(asked, int) or isinstance(asked, bool) or asked < 1
        ):
            raise ApiError(400, f"{name} {asked!r}: a positive integer", param=name)
        if asked is not None:
            budget = min(budget, asked)
        return budget

    def _messages(self, body: dict[str, Any]) -> tuple[Messages, Any]:
        messages, tools = body.get("messages"), body.get("tools")
        if not (isinstance(messages, list) and messages):
            raise ApiError(
                400, "messages: a non-empty list of {role, content} objects", param="messages"
            )
        for m in messages:
            if not (
                isinstance(m, dict)
                and m.get("role") in ("system", "user", "assistant", "tool", "developer")
            ):
                raise ApiError(
                    400,
                    "messages: each a {role, content} object (role system, user, assistant or tool)",
                    param="messages",
                )
            try:
                text_of(m.get("content"))
            except ValueError as exc:
                raise ApiError(400, f"messages: {exc}", param="messages") from None
        if tools is not None and not (isinstance(tools, list) and all(_is_tool(t) for t in tools)):
            raise ApiError(
                400,
                "tools: a list of {type: function, function: {name, parameters}} objects",
                param="tools",
            )
        return messages, tools

    def _render(self, messages: Messages, tools: Any, *, first: bool) -> list[int]:
        """Token ids of ``messages``: a whole prompt (``first``), or new messages after
        the model's last turn."""
        chat: ChatTurns = self.runner.chat
        # the serving engine's tool-call format (shards/engines.py): the schemas only
        # with the first messages, where the conversation's system prompt is
        rendered, template_tools = self.tool_calls.render(messages, tools if first else None)
        if first:
            return chat.first(rendered, template_tools)
        return chat.reply(rendered, self.last_ids)

    def _close(self) -> list[int]:
        """The end of the model's last turn and the next generation prompt."""
        return self.runner.chat.reply(None, self.last_ids)

    def _prompt(self, messages: Messages, tools: Any) -> Episode:
        """The trajectory this request continues, its new messages appended (mask 0),
        or a new one (a split when one was going)."""
        try:
            return self._continue(messages, tools)
        except ChatError as exc:
            raise ApiError(400, f"messages: {exc}") from None

    def _continue(self, messages: Messages, tools: Any) -> Episode:
        k = len(self.served)
        current = self.current
        extends = (
            current is not None
            and k > 0  # served as chat (after a text completion, a chat request splits)
            and len(messages) >= k  # none new: the model's next turn right after its last
            and tools == self.tools
            and all(_key(a) == _key(b) for a, b in zip(messages[:k], self.served, strict=False))
        )
        if extends:
            assert current is not None
            new = messages[k:]
            current.add(
                self._render(new, tools, first=False) if new else self._close(), model=False
            )
            return current
        fresh = self._start(self._render(messages, tools, first=True))  # rendered first:
        self.tools = tools  # a template error leaves the episode as it was
        return fresh

    async def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/chat/completions``: the response body (ApiError for a refusal)."""
        check_fields(body, chat=True)
        messages, tools = self._messages(body)
        turn, budget, prompt = await self._turn(body, lambda: self._prompt(messages, tools))
        # tool_choice "none": calls not read, as vLLM serves it (the tools stay rendered)
        if tools and body.get("tool_choice") != "none":
            call_id = f"call_{self.name}_{self.turns}"
            content, calls = self.tool_calls.parse(self._text_ids(turn.token_ids), call_id, tools)
        else:
            content, calls = self.runner.decode(turn.token_ids), []
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        self.served, self.served_text = [*messages, message], None
        finish = "tool_calls" if calls else ("length" if len(turn.token_ids) >= budget else "stop")
        choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish}
        choice["logprobs"] = None
        if body.get("logprobs"):
            choice["logprobs"] = {"content": self._logprobs(turn.token_ids, turn.logprobs)}
        return self._reply("chatcmpl", "chat.completion", choice, prompt, turn)

    async def complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """``/v1/completions``: a text (or token-id) prompt, continued. Token-exact as
        chat is: a prompt that starts with what was served (the last prompt and its
        completion) reuses those tokens and adds only the rest."""
        check_fields(body, chat=False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = prompt if isinstance(prompt, list) and prompt else None
        if not (isinstance(prompt, str) and prompt) and not (
            ids is not None and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise ApiError(
                400, "prompt: text, or a list of token ids (one prompt: n is 1)", param="prompt"
            )
        given: str | list[int] = prompt if isinstance(prompt, str) else list(ids or [])
        turn, budget, used = await self._turn(body, lambda: self._text_prompt(given))
        text = self.runner.decode(turn.token_ids)
        if isinstance(prompt, str):
            self.served_text, self.served = prompt + text, []
        else:
            self.served_text, self.served = None, []
        finish = "length" if len(turn.token_ids) >= budget else "stop"
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
        choice["logprobs"] = None
        if type(body.get("logprobs")) is int:  # 0 too: each token's (checked: not above 0)
            tokens = [self._token_text(t) for t in turn.token_ids]
            choice["logprobs"] = {"tokens": tokens, "token_logprobs": list(turn.logprobs)}
        return self._reply("cmpl", "text_completion", choice, used, turn)

    def _text_prompt(self, prompt: str | list[int]) -> Episode:
        current = self.current
        stream = current.prompt_ids + current.token_ids if current is not None else []
        if isinstance(prompt, str):
            served = self.served_text
            if current is not None and served is not None and prompt.startswith(served):
                current.add(self._tokens(prompt[len(served) :]), model=False)
                return current
            ids = self._tokens(prompt)
        else:
            if current is not None and prompt[: len(stream)] == stream:
                current.add(list(prompt[len(stream) :]), model=False)
                return current
            ids = list(prompt)
        vocab = len(self.runner.tokenizer)
        if not ids or any(not 0 <= t < vocab for t in ids):
            raise ApiError(
                400, f"prompt: no tokens, or a token id outside the vocabulary ({vocab})"
            )
        return self._start(ids)

    def _start(self, prompt_ids: list[int]) -> Episode:
        """A new trajectory from ``prompt_ids``; the one going, if any, is split off."""
        if self.current is not None:
            self.done.append(self.current)
            self.splits += 1
        self.current = Episode(prompt_ids)
        return self.current

    def _tokens(self, text: str) -> list[int]:
        return list(self.runner.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _reply(
        self, prefix: str, kind: str, choice: dict[str, Any], prompt: int, turn: Any
    ) -> dict[str, Any]:
        return {
            "id": f"{prefix}-{self.name}-{self.turns}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": len(turn.token_ids),
                "total_tokens": prompt + len(turn.token_ids),
            },
        }

    async def _turn(
        self, body: dict[str, Any], extend: Callable[[], Episode]
    ) -> tuple[Any, int, int]:
        """One model turn for a request, on the trajectory ``extend()`` gives (the one it
        continues, its new tokens appended); the turn, its token budget and the prompt's
        length. A refused or failed request leaves no trace."""
        if self.closed:
            raise ApiError(
                401, "this episode is over: its key is no longer valid", "invalid_api_key"
            )
        if self.generating:
            raise ApiError(409, "one request at a time per episode")
        sampling = self._sampling(body)
        mark = self._mark()
        episode = extend()
        try:
            budget = self._budget(episode, body)
        except ApiError as exc:
            self.refusal = exc.message
            self._undo(mark, episode)
            raise
        prompt = episode.prompt_ids + episode.token_ids
        self.generating = True
        # the episode's, not the request handler's: cancelled when the episode ends (a
        # client that went away would otherwise leave it decoding into a closed episode)
        self.pending = asyncio.ensure_future(
            self.generate(prompt, with_budget(sampling, budget), min_version=self.min_version)
        )
        try:
            turn = await asyncio.shield(self.pending)
        except asyncio.CancelledError:
            self._undo(mark, episode)
            task = asyncio.current_task()
            if self.closed and task is not None and not task.cancelling():
                # the episode ended (its generation stopped with it), not this handler
                raise _ended() from None
            raise
        except Exception as exc:
            self._undo(mark, episode)
            if self.closed:
                raise _ended() from None
            self.failure = self.failure or exc
            raise ApiError(503, f"generation failed: {exc}") from exc
        finally:
            self.pending = None
            self.generating = False
            self.idle_since = time.monotonic()
        if self.closed:  # it ended while this turn was sampled: the turn is not its
            self._undo(mark, episode)
            raise _ended()
        self.cut = self.refusal = ""  # a turn after a refusal: no limit ended the episode
        episode.add_turn(turn)
        self.turns += 1
        self.last_ids = list(turn.token_ids)
        return turn, budget, len(prompt)

    def _mark(self) -> tuple[Episode | None, int, int, Any]:
        """Where the episode stands before a request (a refused one is undone)."""
        current = self.current
        length = len(current.token_ids) if current is not None else 0
        return current, len(self.done), length, self.tools

    def _undo(self, mark: tuple[Episode | None, int, int, Any], episode: Episode) -> None:
        """A refused or failed request leaves no trace: no new messages, no split."""
        current, done, length, self.tools = mark
        if episode is current and current is not None:
            del current.token_ids[length:], current.mask[length:]
            del current.logprobs[length:], current.versions[length:]
        else:
            self.current = current
            del self.done[done:]
            self.splits -= int(current is not None)

    def _text_ids(self, ids: list[int]) -> list[int]:
        """A turn's ids without the stop token that ended it, which vLLM's text leaves
        out (a parser that keeps special tokens would otherwise see it)."""
        stops = set(self.sampling.stop_token_ids) if self.sampling is not None else set()
        stops.add(self.runner.tokenizer.eos_token_id)
        return list(ids[:-1] if ids and ids[-1] in stops else ids)

    def _token_text(self, token: int) -> str:
        return str(self.runner.tokenizer.decode([token]))

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> list[dict[str, Any]]:
        out = []
        for t, lp in zip(ids, logprobs, strict=True):
            token = self._token_text(t)
            out.append(
                {"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
            )
        return out

    # --- the episode's end -----------------------------------------------------------

    def finish(self, reward: float, info: dict[str, float]) -> Episode:
        """The last trajectory, the ones split off before it in ``segments``, each with
        the episode's reward."""
        assert self.current is not None
        last = self.current
        for e in (*self.done, last):
            e.reward = reward
            e.info = dict(info)
        last.segments = list(self.done)
        last.splits = self.splits
        last.cut = self.cut
        return last
