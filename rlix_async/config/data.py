"""What a pipeline trains on: a token-id task, or a text recipe's dataset files (the model
and reward live on the pipeline).

A pipeline trains either on a token-id ``task`` (the fast test fixtures) or on
``data`` with a ``reward``: prompts from a file, rendered with the model's chat
template, scored by a function of the user's (``rollout/rewards.py``).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from rlix_async.config.schema_base import Config, doc, invalid


class DataConfig(Config, frozen=True):
    train: Annotated[
        str,
        doc(
            "Training prompts: a .jsonl, .json (a list of objects) or .parquet file, or a "
            "directory written by datasets' save_to_disk. Relative to the current directory.",
            min_length=1,
        ),
    ]
    eval: Annotated[
        str | None, doc("Evaluation prompts, in the same forms (needed by eval_every).")
    ] = None
    prompt_key: Annotated[
        str | None,
        doc(
            "Field holding the prompt text (rendered as one user message with the chat "
            "template). Default 'prompt' unless messages_key is set."
        ),
    ] = None
    messages_key: Annotated[
        str | None,
        doc("Field holding a chat: a list of {role, content} messages (instead of prompt_key)."),
    ] = None
    max_prompt_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc(
            "Rows whose rendered prompt is longer are skipped and counted. Unset: "
            "engine.max_model_len - rollout.max_tokens (set by the launcher)."
        ),
    ] = None
    eval_rows: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc("Evaluate on the first N rows of eval only. Unset: every row."),
    ] = None
    shuffle: Annotated[
        bool, doc("Shuffle the training rows, a new order each epoch (by seed and epoch).")
    ] = True

    def __post_init__(self) -> None:
        if self.prompt_key is not None and self.messages_key is not None:
            raise invalid("messages_key", "set prompt_key or messages_key, not both")

    @property
    def keys(self) -> dict[str, str | None]:
        """The row key arguments of ``rollout/dataset.py`` (prompt_key defaults to 'prompt')."""
        if self.messages_key is not None:
            return {"prompt_key": None, "messages_key": self.messages_key}
        return {"prompt_key": self.prompt_key or "prompt", "messages_key": None}


class TokenTask(Config, frozen=True, tag_field="name"):
    """A reward task on token ids (prompts drawn at random from the vocabulary)."""

    vocab: Annotated[int, doc("Prompt tokens are drawn from [1, vocab).", ge=2)] = 512
    prompt_len: Annotated[int, doc("Prompt length in tokens.", ge=1)] = 4


class TargetTokensTask(TokenTask, frozen=True, tag="target_tokens"):
    """Reward: share of response tokens in [lo, hi) of the vocabulary."""

    lo: Annotated[int, doc("First rewarded token id.", ge=0)] = 0
    hi: Annotated[int, doc("One past the last rewarded token id.", ge=1)] = 32

    def __post_init__(self) -> None:
        if not self.lo < self.hi <= self.vocab:
            raise invalid("hi", f"need lo < hi <= vocab, got {self.lo}, {self.hi}, {self.vocab}")


class CopyFirstTask(TokenTask, frozen=True, tag="copy_first"):
    """Reward: share of response tokens equal to the prompt's first token."""


TaskConfig = TargetTokensTask | CopyFirstTask
