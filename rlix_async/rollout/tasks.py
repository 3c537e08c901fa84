"""Verifiable reward tasks on token ids (no tokenizer).

Each task makes prompts and scores a response in [0, 1]. ``target_tokens``
rewards the share of response tokens inside a fixed band of the vocabulary:
a random model scores about ``band / vocab`` and a policy gradient pushes it
up within a few dozen steps on a CPU. ``copy_first`` rewards repeating the
prompt's first token, a prompt-dependent task that needs the model to attend.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rlix_async.config import CopyFirstTask, TargetTokensTask, TaskConfig


@dataclass(frozen=True)
class Task:
    name: str
    vocab: int
    prompt_len: int
    score: Callable[[Sequence[int], Sequence[int]], float]  # (prompt, response) -> reward

    def prompt(self, rng: random.Random) -> list[int]:
        return [rng.randrange(1, self.vocab) for _ in range(self.prompt_len)]


def target_tokens(vocab: int = 512, lo: int = 0, hi: int = 32, prompt_len: int = 4) -> Task:
    if not 0 <= lo < hi <= vocab:
        raise ValueError(f"target_tokens: need 0 <= lo < hi <= vocab, got {lo}, {hi}, {vocab}")

    def score(prompt: Sequence[int], response: Sequence[int]) -> float:
        if not response:
            return 0.0
        return sum(lo <= t < hi for t in response) / len(response)

    return Task(f"target_tokens[{lo},{hi})", vocab, prompt_len, score)


def copy_first(vocab: int = 512, prompt_len: int = 4) -> Task:
    def score(prompt: Sequence[int], response: Sequence[int]) -> float:
        if not response:
            return 0.0
        return sum(t == prompt[0] for t in response) / len(response)

    return Task("copy_first", vocab, prompt_len, score)


def make_task(cfg: TaskConfig) -> Task:
    """The task a pipeline config names (its fields are validated there)."""
    match cfg:
        case TargetTokensTask():
            return target_tokens(cfg.vocab, cfg.lo, cfg.hi, cfg.prompt_len)
        case CopyFirstTask():
            return copy_first(cfg.vocab, cfg.prompt_len)
