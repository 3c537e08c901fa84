"""Data-plane messages between a pipeline's router and its shard workers."""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec

from rlix_async.protocol import Message

Positive = Annotated[int, msgspec.Meta(ge=1)]


class ShardRefusal(enum.StrEnum):
    """Why a shard refused a request before decoding it (the RpcError's code)."""

    PREEMPTED = "preempted"  # not serving (asleep, draining): try another shard
    STALE_WEIGHTS = "stale_weights"  # older weights than the request accepts
    CANCELLED = "cancelled"  # its caller gave up before it started


class Sampling(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How one response is sampled: built once from the pipeline's config (or by a
    caller), it travels unchanged through the router, the wire and the shard worker
    to the engine (vLLM's ``SamplingParams``). A request resumed after a shrink is
    the same sampling with the tokens left (``msgspec.structs.replace``)."""

    max_tokens: Positive
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 1.0  # 0: greedy
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    seed: int | None = None
    # Text recipes: end the response at any of these token ids (the tokenizer's
    # end-of-sequence) or strings (kept in the response). A string split across the
    # point where a shrink cut the response is not seen by the resumed request.
    stop_token_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=64)] = ()
    stop: Annotated[tuple[str, ...], msgspec.Meta(max_length=16)] = ()


class Generate(Message):
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    prompt_ids: Annotated[list[int], msgspec.Meta(min_length=1)]
    sampling: Sampling
    # The oldest weight version this request may run on (None: any). A shard on
    # older weights refuses it with "stale_weights" before decoding anything, so
    # a pipeline never collects trajectories its staleness bound would drop.
    min_version: Annotated[int, msgspec.Meta(ge=0)] | None = None


class GenerateResult(Message):
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    weight_version: int | None
    preempted: bool = False  # cut by a shrink: resume elsewhere from token_ids
    # routing replay: the experts the engine routed each input token of this attempt
    # to, its prompt (for a resumed attempt: the original prompt and the earlier tokens)
    # and its tokens but the last (Group.routes's format); b"": none recorded
    routes: bytes = b""


class Cancel(Message):
    """Notification: the caller gave up on these requests (its call was cancelled);
    the shard stops decoding them and frees their slots."""

    request_ids: Annotated[list[str], msgspec.Meta(min_length=1, max_length=1024)]
