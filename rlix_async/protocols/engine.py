"""What a shard worker needs from an inference engine, in one place.

:class:`~rlix_async.shards.vllm.engine.VllmEngine` is the production engine;
an engine of your own (``engine.kind: custom`` in the config) implements the
same protocol. How an engine kind is started, and what else it declares (whether
it uses CUDA, its environment, its tool-call format), is its backend's
(``shards/engines.py``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.generation import Sampling

PauseMode = Literal["abort", "keep"]


@dataclass
class GenerationChunk:
    token_ids: list[int]  # all tokens generated so far for this request
    logprobs: list[float] = field(default_factory=list)
    finished: bool = False
    weight_version: int | None = None  # the weights these tokens were decoded with
    # why it finished: "stop" (end of sequence, a stop token or string) and "length"
    # (max_tokens) are ends of the response; "abort" or None (unknown) is not
    finish_reason: str | None = None
    # routing replay, on the last chunk only: the experts the engine routed each input
    # token to, positions 0 .. len(prompt) + len(token_ids) - 2 (Group.routes's format);
    # b"": none recorded (a dense model, replay off, or positions missing)
    routes: bytes = b""


class ShardEngine(Protocol):
    weight_version: int | None

    def generate(
        self, prompt_ids: list[int], sampling: Sampling, *, request_id: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        """Cumulative outputs of one request; cancelling the iteration aborts it.
        It ends early at a token of ``sampling.stop_token_ids`` or a string of
        ``sampling.stop`` (both kept in the output)."""
        ...

    async def load_version(self, ref: CacheRef) -> int | None:
        """Reach the cached weights ``ref`` (or a newer version, if the owner moved on
        meanwhile: return its number; None means ``ref``'s). A ``SyncError``: the old
        weights serve on; any other failure: they may be partly new (the shard serves
        nothing until a later load succeeds)."""
        ...

    async def abort_all(self) -> int: ...
    def num_running(self) -> int: ...
    async def pause(self, mode: PauseMode = "abort") -> None:
        """``keep``: freeze running requests (they resume); ``abort``: end them."""
        ...

    async def resume(self) -> None: ...
    async def sleep(self, level: int = 2) -> None:
        """Level 2 drops the weights (the next wake resyncs) and the KV cache."""
        ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...


class AdapterEngine(ShardEngine, Protocol):
    """The engine of a base group's shard (LoRA pipelines on one frozen base model):
    each request may name a member's adapter, and each member's adapter versions
    load beside the others'."""

    adapter_versions: dict[str, int]  # member -> the version its new requests get

    def generate(
        self,
        prompt_ids: list[int],
        sampling: Sampling,
        *,
        request_id: str | None = None,
        adapter: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """As ShardEngine's, with ``adapter``'s newest version (None: the base model;
        each chunk's weight_version is that adapter version)."""
        ...

    async def load_adapter(self, name: str, ref: CacheRef) -> None:
        """Load (or replace) adapter ``name`` at ``ref.version`` from the weight cache,
        without pausing any request: running ones finish on the version they started
        on. On failure the previous version serves on."""
        ...


Messages = list[dict[str, Any]]


class ToolCallFormat(Protocol):
    """How the served model reads tool schemas and writes tool calls: what the
    pipeline's OpenAI-compatible endpoint (rollout/api_episode.py) needs from the
    engine behind it, as ``vllm serve``'s chat template and ``--tool-call-parser`` are.
    Built for one model's tokenizer (its backend's ``tool_calls``)."""

    def prepare(self) -> None:
        """Load what parsing needs (it may import the engine's parsers: seconds); the
        endpoint calls it once, off its event loop, before it serves a request."""
        ...

    def render(
        self, messages: Messages, tools: list[dict[str, Any]] | None
    ) -> tuple[Messages, list[dict[str, Any]] | None]:
        """OpenAI ``messages`` (and ``tools``, None for messages after the first) as the
        tokenizer's chat template takes them, with the tools it takes (None: the
        schemas, if any, are in the messages)."""
        ...

    def parse(
        self, token_ids: list[int], call_id: str, tools: list[dict[str, Any]]
    ) -> tuple[str | None, list[dict[str, Any]]]:
        """The model's turn (its token ids) for a request that offered ``tools``, as
        (content, OpenAI ``tool_calls``); text that is not a well-formed call stays
        content (a malformed call is the model's answer, never a server error). Call
        ids are ``call_id`` and the call's number."""
        ...
