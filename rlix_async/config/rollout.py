"""How a pipeline's responses are sampled and collected: the sampling the engine and the
trainer's log-probs share, the groups per step and in flight."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from rlix_async.config.schema_base import Config, doc
from rlix_async.protocols.generation import Sampling


class RolloutConfig(Config, frozen=True):
    groups_per_step: Annotated[int, doc("Prompts (groups) per training step.", ge=1)] = 8
    group_size: Annotated[
        int, doc("Responses sampled per prompt (GRPO needs two or more).", ge=2)
    ] = 4
    max_tokens: Annotated[int, doc("Longest response, in tokens.", ge=1)] = 12
    temperature: Annotated[
        float,
        doc(
            "Sampling temperature (> 0: the trainer's log-probs use the same one, so the "
            "importance ratio compares like with like).",
            gt=0,
        ),
    ] = 1.0
    top_p: Annotated[
        float,
        doc("Nucleus sampling; the trainer's log-probs are renormalised the same way.", gt=0, le=1),
    ] = 1.0
    stop: Annotated[
        Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]], msgspec.Meta(max_length=16)],
        doc(
            "Text recipes: stop a response at any of these strings (kept in the response). "
            "Every response also stops at the tokenizer's end-of-sequence token."
        ),
    ] = []
    max_groups_in_flight: Annotated[int, doc("Groups being generated at once, at most.", ge=1)] = 4
    drop_uniform_groups: Annotated[
        bool,
        doc(
            "DAPO dynamic sampling: a group whose rewards are all equal (no advantage, no "
            "gradient) is dropped and counted (metrics `filtered`), and another prompt "
            "takes its place."
        ),
    ] = False

    def sampling(self, stop_token_ids: Sequence[int] = ()) -> Sampling:
        """How each response is sampled (``stop_token_ids``: the tokenizer's end of
        sequence, which the config does not know): the one struct that travels to
        the engine unchanged."""
        return Sampling(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop_token_ids=tuple(stop_token_ids),
            stop=tuple(self.stop),
        )
