"""Simulator scenarios (YAML): cluster, switch costs, pipelines. Unknown keys are refused.

Defaults for optional keys: ``plan_interval_s: 1`` (the planner's debounce),
``switch`` all zero except ``sync_gib_per_s: 2``
and ``model_gib: 0``; a pipeline's ``start_s: 0``, ``steps: 10``,
``step_target: 64``, ``max_staleness: 1``, ``slots_per_shard: 16``,
``reprefill_s: 0`` (cost of resuming a cut trajectory elsewhere), rollout
``{dist: lognormal, median_s: 60, sigma: 1.0, max_s: 3600}``, stages
``{ACTOR_TRAINING: 60}``. ``dist`` is ``lognormal``, ``pareto`` (``median_s``
and tail index ``alpha``) or ``fixed`` (every trajectory takes ``median_s``).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from rlix_async.control.topology import ClusterShape, ClusterSpec

Pos = Annotated[float, msgspec.Meta(gt=0)]
NonNeg = Annotated[float, msgspec.Meta(ge=0)]


class ClusterIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nodes: Annotated[int, msgspec.Meta(ge=1)]
    gpus_per_node: Annotated[int, msgspec.Meta(ge=1)]


class Switch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    sleep_s: NonNeg = 0.0
    wake_s: NonNeg = 0.0
    sync_gib_per_s: Pos = 2.0
    model_gib: NonNeg = 0.0

    @property
    def sync_s(self) -> float:
        return self.model_gib / self.sync_gib_per_s


class Rollout(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    dist: Literal["lognormal", "pareto", "fixed"] = "lognormal"
    median_s: Pos = 60.0
    sigma: NonNeg = 1.0  # lognormal
    alpha: Pos = 1.5  # pareto tail index
    max_s: Pos = 3600.0

    def sample(self, rng: random.Random) -> float:
        if self.dist == "fixed":
            d = self.median_s
        elif self.dist == "lognormal":
            d = rng.lognormvariate(math.log(self.median_s), self.sigma)
        else:  # pareto with this median: scale = median / 2^(1/alpha)
            d = self.median_s / 2 ** (1 / self.alpha) * rng.paretovariate(self.alpha)
        return min(d, self.max_s)


class ClusterDecl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tp: Annotated[int, msgspec.Meta(ge=1)] = 1
    devices: list[int] = []


class PipelineDecl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: str
    clusters: dict[str, ClusterDecl]
    start_s: NonNeg = 0.0
    steps: Annotated[int, msgspec.Meta(ge=1)] = 10
    step_target: Annotated[int, msgspec.Meta(ge=1)] = 64
    max_staleness: Annotated[int, msgspec.Meta(ge=0)] = 1
    slots_per_shard: Annotated[int, msgspec.Meta(ge=1)] = 16
    reprefill_s: NonNeg = 0.0
    rollout: Rollout = Rollout()
    stages: dict[str, NonNeg] = msgspec.field(default_factory=lambda: {"ACTOR_TRAINING": 60.0})

    def topology(self) -> dict[str, ClusterSpec]:
        return {n: ClusterSpec(c.tp, tuple(c.devices)) for n, c in self.clusters.items()}

    @property
    def train_s(self) -> float:
        return sum(self.stages.values())

    def devices(self) -> set[int]:
        return {d for c in self.clusters.values() for d in c.devices}


class Scenario(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cluster: ClusterIn
    pipelines: list[PipelineDecl]
    switch: Switch = Switch()
    plan_interval_s: NonNeg = 1.0  # planner debounce (simulated seconds)

    @property
    def shape(self) -> ClusterShape:
        return ClusterShape(self.cluster.nodes, self.cluster.gpus_per_node)


class ScenarioError(ValueError):
    pass


def load_scenario(path: str | Path) -> Scenario:
    import yaml

    from rlix_async.control.topology import TopologyError, validate_topology

    try:
        raw = yaml.safe_load(Path(path).read_text())
        sc = msgspec.convert(raw, Scenario)
    except (OSError, yaml.YAMLError) as exc:
        raise ScenarioError(f"{path}: cannot read: {exc}") from None
    except msgspec.ValidationError as exc:
        raise ScenarioError(f"{path}: {exc}") from None
    ids = [p.id for p in sc.pipelines]
    if len(set(ids)) != len(ids):
        raise ScenarioError(f"{path}: duplicate pipeline ids")
    for p in sc.pipelines:
        if "actor_train" not in p.clusters or "actor_infer" not in p.clusters:
            raise ScenarioError(f"{path}: pipeline {p.id} needs actor_train and actor_infer")
        try:
            validate_topology(p.topology(), sc.shape)
        except TopologyError as exc:
            raise ScenarioError(f"{path}: pipeline {p.id}: {exc}") from None
    return sc
