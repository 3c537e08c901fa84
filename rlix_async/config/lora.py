"""LoRA pipelines and their base groups (issue 21).

A pipeline with ``lora`` trains an adapter on its frozen ``model.path``. LoRA
pipelines on the same base model form a *base group*: one set of shards, started
with LoRA enabled, serves every member's requests, each with its member's
adapter (docs/SCHEDULING.md, "Base groups"). Which pipelines form a group, and the
rules that make sharing those shards possible, are in ``launch_rules.py``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from rlix_async.config.schema_base import Config, doc, invalid

# What vLLM serves LoRA on for Llama-family models (its packed qkv and gate_up
# projections take adapters on any of their parts). Embedding and lm_head adapters
# are not served, so they are not trained either.
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[LoraTarget, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


class LoraConfig(Config, frozen=True):
    rank: Annotated[int, doc("The adapter's rank r.", ge=1, le=512)] = 8
    alpha: Annotated[float, doc("lora_alpha: the update is scaled by alpha / rank.", gt=0)] = 16.0
    target_modules: Annotated[
        list[LoraTarget],
        doc(
            "The linear layers that get an adapter (Llama-family names; vLLM serves "
            "adapters on these only).",
            min_length=1,
        ),
    ] = msgspec.field(default_factory=lambda: list(LORA_TARGETS))
    dropout: Annotated[
        float, doc("Dropout on the adapter's input, in training only.", ge=0, lt=1)
    ] = 0.0
    layers: Annotated[
        Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(min_length=1)] | None,
        doc(
            "The decoder layers (0-based) that get adapters (peft's "
            "layers_to_transform); unset: every layer. The backward pass stops at the "
            "first adapted layer, so adapting only the last few makes a step much cheaper."
        ),
    ] = None

    def __post_init__(self) -> None:
        if len(set(self.target_modules)) != len(self.target_modules):
            raise invalid("target_modules", f"{self.target_modules} names a module twice")
        if self.layers is not None and len(set(self.layers)) != len(self.layers):
            raise invalid("layers", f"{self.layers} names a layer twice")


class EngineLoraConfig(Config, frozen=True):
    max_lora_rank: Annotated[
        Literal[1, 8, 16, 32, 64, 128, 256, 320, 512],
        doc("The largest adapter rank a shard serves (vLLM's max_lora_rank)."),
    ] = 16
    max_loras: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc(
            "Adapters one shard batches at once (vLLM's max_loras). Unset: twice the "
            "largest base group, so every member's old and new version fit while a new "
            "one loads; set, at least the largest group."
        ),
    ] = None


def base_group_id(path: str) -> str:
    """The id of the base group on the model directory ``path``: readable, stable
    across restarts, a valid pipeline id."""
    name = re.sub(r"[^\w.\-]", "_", Path(path).name or "model")
    return f"base.{name}"[:64]
