"""The rules across configs, in one place: what a launch's pipelines, cluster and
engine must agree on, and the base groups LoRA pipelines form. Checked before any
process starts (LaunchConfig runs them when it is built, from a file or in code)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rlix_async.config.engine import EngineConfig, VllmEngineConfig
from rlix_async.config.lora import base_group_id
from rlix_async.config.pipeline import PipelineConfig
from rlix_async.config.schema_base import invalid
from rlix_async.config.training import TorchTrainConfig
from rlix_async.protocols.topology import (
    ClusterName,
    ClusterShape,
    ClusterSpec,
    TopologyError,
    validate_topology,
)


def check_launch(
    pipelines: Sequence[PipelineConfig],
    cluster: ClusterShape,
    engine: EngineConfig,
    node_addresses: Sequence[str] | None = None,
) -> None:
    """Every rule a launch needs across its pipelines, cluster and engine: one-line
    config errors before any process starts."""
    if node_addresses is not None and len(node_addresses) != cluster.nodes:
        raise invalid(
            "node_addresses", f"{len(node_addresses)} addresses for {cluster.nodes} nodes"
        )
    seen: set[str] = set()
    for i, p in enumerate(pipelines):
        at = f"pipelines[{i}]"
        if p.id in seen:
            raise invalid(f"{at}.id", f"duplicate pipeline id {p.id!r}")
        seen.add(p.id)
        for key in ("out", "coordinator", "keys", "base_group", "trainer_endpoint"):
            if getattr(p, key) is not None:
                raise invalid(f"{at}.{key}", "set by the launcher; remove it")
        check_topology(f"{at}.clusters", p.clusters, cluster)
        infer_tp = p.clusters["actor_infer"].tp
        if infer_tp > cluster.gpus_per_node:
            raise invalid(
                f"{at}.clusters.actor_infer.tp",
                f"{infer_tp} > gpus_per_node={cluster.gpus_per_node}: a shard "
                "(one vLLM engine) runs on one node",
            )
        check_infer_heads(at, p, infer_tp)
        if p.data is not None and p.data.max_prompt_tokens is not None:
            longest = p.data.max_prompt_tokens + p.rollout.max_tokens
            if longest > engine.max_model_len:
                raise invalid(
                    f"{at}.data.max_prompt_tokens",
                    f"{p.data.max_prompt_tokens} + rollout.max_tokens "
                    f"{p.rollout.max_tokens} > engine.max_model_len "
                    f"{engine.max_model_len}",
                )
        if p.data is not None and p.rollout.max_tokens >= engine.max_model_len:
            raise invalid(
                f"{at}.rollout.max_tokens",
                f"{p.rollout.max_tokens} leaves no room for a prompt in "
                f"engine.max_model_len {engine.max_model_len}",
            )
        check_trainer_nodes(at, p, cluster, node_addresses)
    check_base_groups(pipelines, engine)


def check_infer_heads(at: str, p: PipelineConfig, tp: int) -> None:
    """A shard of tensor-parallel size ``tp`` splits the model's attention heads over
    its ranks (vLLM refuses a split that is not whole, after its engine started):
    heads divisible by tp, and key-value heads divisible by it or dividing it (vLLM
    replicates them). Read from model.path's config.json, or the tiny model's shape
    (heads of 64); a directory unreadable here is left to the engine."""
    if tp == 1:
        return
    if p.model.path is None:
        heads = kv = p.model.hidden // 64
    else:
        try:
            c = json.loads(Path(p.model.path, "config.json").read_text())
            c = c.get("text_config", c)
            heads = int(c["num_attention_heads"])
            kv = int(c.get("num_key_value_heads") or heads)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
    if heads % tp or (kv % tp and tp % kv):
        raise invalid(
            f"{at}.clusters.actor_infer.tp",
            f"{tp}: the model has {heads} attention heads and {kv} key-value heads; "
            "a shard's tensor parallel must divide the heads and divide or be divided "
            "by the key-value heads",
        )


def check_trainer_nodes(
    at: str, p: PipelineConfig, cluster: ClusterShape, node_addresses: Sequence[str] | None
) -> None:
    """A trainer spanning nodes: its other nodes find rank 0's store at an address the
    config lists. (Its tensor-parallel groups are whole bundles, which never cross a
    node: the topology rules.)"""
    spec = p.clusters["actor_train"]
    nodes = sorted({d // cluster.gpus_per_node for d in spec.devices})
    if len(nodes) > 1 and node_addresses is None:
        raise invalid(
            f"{at}.clusters.actor_train.devices",
            f"{list(spec.devices)} span nodes {nodes}: a trainer across nodes needs "
            "node_addresses (each node's address, node 0 first)",
        )


def check_topology(at: str, clusters: dict[ClusterName, ClusterSpec], shape: ClusterShape) -> None:
    try:
        validate_topology(dict(clusters), shape)
    except TopologyError as exc:
        raise invalid(at, str(exc)) from None


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
        if not isinstance(p.train, TorchTrainConfig):
            raise invalid(where, f"{p.id}: LoRA trains with train.backend torch (peft)")
        layers = _layer_count(p.model.path)
        if p.lora.layers and layers is not None and max(p.lora.layers) >= layers:
            raise invalid(
                f"{where}.layers",
                f"{p.id}: layer {max(p.lora.layers)}, but {p.model.path} has {layers} "
                f"layers (0-{layers - 1})",
            )
        if isinstance(engine, VllmEngineConfig) and p.lora.rank > engine.lora.max_lora_rank:
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
    if not isinstance(engine, VllmEngineConfig):  # an engine of your own: its own knobs
        return
    if engine.lora.max_loras is not None and engine.lora.max_loras < largest:
        raise invalid(
            "engine.lora.max_loras",
            f"{engine.lora.max_loras} < {largest}, the adapters of the largest base group",
        )
