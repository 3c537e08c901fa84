"""LoRA pipelines and their base groups (issue 21).

A pipeline with ``lora`` trains an adapter on its frozen ``model.path``. LoRA
pipelines on the same base model form a *base group*: one set of shards, started
with LoRA enabled, serves every member's requests, each with its member's
adapter (docs/SCHEDULING.md, "Base groups"). The rules that make sharing those
shards possible are checked here, before any process starts.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import msgspec

from rlix_async.config.schema_base import Config, doc, invalid

if TYPE_CHECKING:
    from rlix_async.config.schema import EngineConfig, PipelineConfig

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


def base_groups(pipelines: Sequence[PipelineConfig]) -> dict[str, list[PipelineConfig]]:
    """group id -> its members, in config order: LoRA pipelines by base model directory
    (two different directories with one name get ``.2``, ``.3``...)."""
    by_path: dict[str, list[PipelineConfig]] = {}
    for p in pipelines:
        if p.lora is not None and p.model.path is not None:
            by_path.setdefault(str(Path(p.model.path).resolve()), []).append(p)
    out: dict[str, list[PipelineConfig]] = {}
    for path, members in by_path.items():
        gid = base_group_id(path)
        n = 1
        while gid in out:
            n += 1
            gid = f"{base_group_id(path)[:60]}.{n}"
        out[gid] = members
    return out


def _layer_count(path: str) -> int | None:
    """The decoder layers of the HF model directory ``path`` (its config.json), or None
    where that cannot be read here (the trainer's load reports it)."""
    try:
        cfg = json.loads(Path(path, "config.json").read_text())
        n = cfg.get("text_config", cfg)["num_hidden_layers"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return n if isinstance(n, int) else None


def check_base_groups(pipelines: Sequence[PipelineConfig], engine: EngineConfig) -> None:
    """Every rule a base group's shared shards need, as one-line config errors that
    name the pipelines."""
    at = {p.id: f"pipelines[{i}]" for i, p in enumerate(pipelines)}
    for p in pipelines:
        if p.lora is None:
            continue
        where = f"{at[p.id]}.lora"
        if p.model.path is None:
            raise invalid(where, f"{p.id}: an adapter trains on a base model: set model.path")
        if p.train.backend != "torch":
            raise invalid(where, f"{p.id}: LoRA trains with train.backend torch (peft)")
        layers = _layer_count(p.model.path)
        if p.lora.layers and layers is not None and max(p.lora.layers) >= layers:
            raise invalid(
                f"{where}.layers",
                f"{p.id}: layer {max(p.lora.layers)}, but {p.model.path} has {layers} "
                f"layers (0-{layers - 1})",
            )
        if p.lora.rank > engine.lora.max_lora_rank:
            raise invalid(
                f"{where}.rank",
                f"{p.id}: rank {p.lora.rank} > engine.lora.max_lora_rank "
                f"{engine.lora.max_lora_rank}",
            )
    ids = {p.id for p in pipelines}
    groups = base_groups(pipelines)
    for gid, members in groups.items():
        first = members[0]
        if gid in ids:
            raise invalid(
                f"{at[gid]}.id", f"{gid} is the id of the base group of {first.model.path}"
            )
        for p in members[1:]:
            if p.clusters["actor_infer"] != first.clusters["actor_infer"]:
                raise invalid(
                    f"{at[p.id]}.clusters.actor_infer",
                    f"{p.id} and {first.id} train adapters on one base "
                    f"({first.model.path}): they share its shards, so actor_infer must "
                    "be the same",
                )
            if p.max_model_len != first.max_model_len:
                raise invalid(
                    f"{at[p.id]}.max_model_len",
                    f"{p.id} and {first.id} share one base's shards: max_model_len "
                    f"{p.max_model_len} != {first.max_model_len}",
                )
    largest = max((len(m) for m in groups.values()), default=0)
    if engine.lora.max_loras is not None and engine.lora.max_loras < largest:
        raise invalid(
            "engine.lora.max_loras",
            f"{engine.lora.max_loras} < {largest}, the adapters of the largest base group",
        )
