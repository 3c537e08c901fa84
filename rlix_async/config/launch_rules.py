"""The rules of a whole launch (LaunchConfig): what its pipelines, its cluster and its
engine must agree on, checked before any process starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlix_async.config.lora import check_base_groups
from rlix_async.config.schema_base import invalid
from rlix_async.control.topology import (
    ClusterName,
    ClusterShape,
    ClusterSpec,
    TopologyError,
    validate_topology,
)

if TYPE_CHECKING:
    from rlix_async.config.schema import LaunchConfig


def check_launch(cfg: LaunchConfig) -> None:
    """Every rule a launch needs across its pipelines, cluster and engine: one-line
    config errors before any process starts."""
    seen: set[str] = set()
    for i, p in enumerate(cfg.pipelines):
        at = f"pipelines[{i}]"
        if p.id in seen:
            raise invalid(f"{at}.id", f"duplicate pipeline id {p.id!r}")
        seen.add(p.id)
        for key in ("out", "coordinator", "keys", "base_group"):
            if getattr(p, key) is not None:
                raise invalid(f"{at}.{key}", "set by the launcher; remove it")
        check_topology(f"{at}.clusters", p.clusters, cfg.cluster)
        infer_tp = p.clusters["actor_infer"].tp
        if infer_tp > cfg.cluster.gpus_per_node:
            raise invalid(
                f"{at}.clusters.actor_infer.tp",
                f"{infer_tp} > gpus_per_node={cfg.cluster.gpus_per_node}: a shard "
                "(one vLLM engine) runs on one node",
            )
        if p.data is not None and p.data.max_prompt_tokens is not None:
            longest = p.data.max_prompt_tokens + p.rollout.max_tokens
            if longest > cfg.engine.max_model_len:
                raise invalid(
                    f"{at}.data.max_prompt_tokens",
                    f"{p.data.max_prompt_tokens} + rollout.max_tokens "
                    f"{p.rollout.max_tokens} > engine.max_model_len "
                    f"{cfg.engine.max_model_len}",
                )
        if p.data is not None and p.rollout.max_tokens >= cfg.engine.max_model_len:
            raise invalid(
                f"{at}.rollout.max_tokens",
                f"{p.rollout.max_tokens} leaves no room for a prompt in "
                f"engine.max_model_len {cfg.engine.max_model_len}",
            )
        train = p.clusters["actor_train"].devices
        nodes = sorted({d // cfg.cluster.gpus_per_node for d in train})
        if len(nodes) > 1:
            raise invalid(
                f"{at}.clusters.actor_train.devices",
                f"{list(train)} span nodes {nodes}: a trainer runs on one node "
                f"(torchrun --standalone; gpus_per_node={cfg.cluster.gpus_per_node})",
            )
    check_base_groups(cfg.pipelines, cfg.engine)


def check_topology(at: str, clusters: dict[ClusterName, ClusterSpec], shape: ClusterShape) -> None:
    try:
        validate_topology(dict(clusters), shape)
    except TopologyError as exc:
        raise invalid(at, str(exc)) from None
