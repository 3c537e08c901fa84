"""Episode test helpers: the tiny tokenizer's chat turns, and ``scripted_generate``, a
stand-in for the router's ``generate`` where no shard runs (the episode and agent unit
tests; tests/integration/test_episode_resume.py runs episodes through the real router)."""

from __future__ import annotations

from typing import Any

from helpers.tiny_text import tiny_tokenizer
from rlix_async.protocols.generation import Sampling
from rlix_async.rollout.chat import ChatTurns
from rlix_async.shards.router import Trajectory

TOKENIZER = tiny_tokenizer()
CHAT = ChatTurns(TOKENIZER)


def ids(text: str) -> list[int]:
    return list(TOKENIZER(text, add_special_tokens=False)["input_ids"])


def decode(tokens: list[int]) -> str:
    return str(TOKENIZER.decode(tokens, skip_special_tokens=True))


def scripted_generate(turns: list[str], seen: list[list[int]]) -> Any:
    """Answers the n-th call with the n-th text's ids (version 3, log-prob -1 each) and
    records the prompt ids it was given."""
    calls = iter(turns)

    async def generate(prompt_ids: list[int], sampling: Sampling, **_: Any) -> Trajectory:
        seen.append(list(prompt_ids))
        out = ids(next(calls))[: sampling.max_tokens]
        return Trajectory(list(prompt_ids), out, [-1.0] * len(out), [3] * len(out))

    return generate
