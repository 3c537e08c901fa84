"""Every request field of the agent endpoint: honoured exactly, or refused with a 400
that names it (OpenAI's error, its ``param`` the field).

A field the endpoint does not serve is never accepted and ignored: an agent that asks
for JSON mode or a forced tool call and silently gets neither learns from replies it
did not ask for. The reasons, by kind:

- A field that changes the sampling distribution (``logit_bias``, the penalties, a
  ``temperature`` or ``top_p`` other than the pipeline's) would make the sampler's
  log-probs those of another distribution than the one the trainer computes: the
  importance ratios would be wrong. Their neutral values (0, ``{}``) are served.
- Constrained decoding (``response_format`` other than text, ``tool_choice``
  ``required`` or a named function, ``parallel_tool_calls: false``) is not served: its
  log-probs would have to stay exact across a shrink's cut and a resume on another
  shard, and no such path exists yet.
- ``seed``: a turn may be cut by a shrink and finished on another shard, so no seed
  makes it reproducible.
- Identifiers that change no reply (``user``, ``safety_identifier``, ``metadata``,
  ``prompt_cache_key``) are served: the reply is what it would be without them.
- ``model``: any name; the pipeline's policy serves every request, and the reply's
  ``model`` says so (as OpenAI's aliases answer with the model that served).
- Anything else (a field of a newer API, an extension of another server: ``top_k``,
  ``min_p``) is refused by name.

The fields the episode itself reads (``messages``, ``tools``, ``temperature``,
``top_p``, ``stop``, ``max_tokens``, ``max_completion_tokens``, ``logprobs``,
``prompt``) are checked there (rollout/api_episode.py), against the pipeline's limits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlix_async.rollout.openai_server import ApiError

Check = Callable[[Any], str | None]  # None: served; else why the value is refused

SAMPLING = (
    "changes the sampling distribution: the trainer's log-probs assume the pipeline's "
    "sampling, so the importance ratios would be wrong"
)
CONSTRAINED = (
    "needs constrained decoding, which this endpoint does not serve (its log-probs "
    "would have to stay exact across a shrink's cut and resume)"
)


def _same(value: Any, served: Any) -> bool:
    """Equal and of the same type: ``true`` is not ``1``, ``"false"`` not ``false``."""
    if type(served) is float:  # a number: 0 is 0.0
        return type(value) in (int, float) and value == served
    return type(value) is type(served) and value == served


def _only(*served: Any, why: str) -> Check:
    """Served when absent (null) or one of ``served`` (same type)."""
    return lambda value: None if value is None or any(_same(value, s) for s in served) else why


def _text(value: Any) -> str | None:
    return None if value is None or isinstance(value, str) else "must be a string"


def _metadata(value: Any) -> str | None:
    if value is None or (
        isinstance(value, dict) and all(isinstance(v, str) for v in value.values())
    ):
        return None
    return "must be an object of strings"


def _episode_reads(value: Any) -> str | None:
    return None  # the episode checks it against the pipeline's settings


def _tool_choice(value: Any) -> str | None:
    if value in (None, "auto", "none"):
        return None
    return f"{value!r} {CONSTRAINED} (auto and none are served)"


def _stream_options(value: Any) -> str | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        return "must be an object"
    extra = set(value) - {"include_usage", "include_obfuscation"}
    if extra:
        return f"{', '.join(sorted(extra))}: not served (include_usage is)"
    if _bool(value.get("include_usage")) is not None:
        return "include_usage must be true or false"
    if value.get("include_obfuscation") is not None and value["include_obfuscation"] is not False:
        return "include_obfuscation: not served (the stream carries no padding)"
    return None


def _bool(value: Any) -> str | None:
    return None if value is None or isinstance(value, bool) else "must be true or false"


_top_logprobs = _only(
    0, why="the top alternatives are not served (logprobs: true gives each token's)"
)
_n = _only(1, why="must be 1: each sample is its own episode's turn")


# the fields of both endpoints
COMMON: dict[str, Check] = {
    "model": _text,
    "temperature": _episode_reads,
    "top_p": _episode_reads,
    "stop": _episode_reads,
    "max_tokens": _episode_reads,
    "n": _n,
    "frequency_penalty": _only(0.0, why=SAMPLING),
    "presence_penalty": _only(0.0, why=SAMPLING),
    "logit_bias": _only({}, why=SAMPLING),
    "seed": _only(
        why="a turn may be cut by a shrink and finished on another shard, so no seed "
        "makes it reproducible"
    ),
    "stream": _bool,
    "stream_options": _stream_options,
    "user": _text,
}

CHAT: dict[str, Check] = {
    **COMMON,
    "messages": _episode_reads,
    "tools": _episode_reads,
    "max_completion_tokens": _episode_reads,
    "logprobs": _bool,
    "top_logprobs": _top_logprobs,
    "tool_choice": _tool_choice,
    "parallel_tool_calls": _only(True, why=f"false {CONSTRAINED}"),
    "response_format": _only({"type": "text"}, why=CONSTRAINED),
    "functions": _only(why="the deprecated functions API is not served: use tools"),
    "function_call": _only(why="the deprecated functions API is not served: use tool_choice"),
    "modalities": _only(["text"], why="only text is served"),
    "audio": _only(why="audio output is not served"),
    "prediction": _only(why="predicted outputs are not served"),
    "web_search_options": _only(why="web search is not served"),
    "reasoning_effort": _only(why="not a setting of the served model"),
    "verbosity": _only(why="not a setting of the served model"),
    "moderation": _only(why="moderation is not served"),
    "store": _only(False, why="completions are not stored"),
    "metadata": _metadata,
    "service_tier": _only("auto", "default", why="one tier is served: auto"),
    "safety_identifier": _text,
    "prompt_cache_key": _text,
    "prompt_cache_retention": _only(why="the engine's prefix cache decides what it keeps"),
    "prompt_cache_options": _only(why="the engine's prefix cache decides what it keeps"),
}

COMPLETIONS: dict[str, Check] = {
    **COMMON,
    "prompt": _episode_reads,
    "logprobs": _only(
        0, why="the top alternatives are not served (logprobs: 0 gives each token's)"
    ),
    "echo": _only(False, why="the prompt is not echoed"),
    "suffix": _only(why="insertion (a suffix) is not served"),
    "best_of": _only(1, why="must be 1: each sample is its own episode's turn"),
    "stream": _only(False, why="served for chat completions only"),
}


def check_fields(body: dict[str, Any], *, chat: bool) -> None:
    """Refuse (ApiError 400, naming the field) a request field not served as asked."""
    table = CHAT if chat else COMPLETIONS
    for name, value in body.items():
        check = table.get(name)
        if check is None:
            endpoint = "chat completions" if chat else "completions"
            raise ApiError(
                400, f"{name}: not a request field this {endpoint} endpoint serves", param=name
            )
        why = check(value)
        if why is not None:
            raise ApiError(400, f"{name} {value!r}: {why}", param=name)
    if body.get("stream_options") is not None and not body.get("stream"):
        raise ApiError(400, "stream_options: only with stream: true", param="stream_options")
