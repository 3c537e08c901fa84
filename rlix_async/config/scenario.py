"""The simulator's scenario: a cluster, pipelines with stage times, and switch costs.

``rlix-async simulate SCENARIO.yaml`` reads a :class:`Scenario`; its pipelines
use the same topology rules as the real ones (``config/launch_rules.py``).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rlix_async.config.launch_rules import check_topology
from rlix_async.config.schema_base import Config, doc, invalid
from rlix_async.protocols.cadence import PLAN_INTERVAL_S, PROGRESS_INTERVAL_S
from rlix_async.protocols.topology import (
    ClusterName,
    ClusterShape,
    ClusterSpec,
    PipelineId,
    PriorityName,
)


class SwitchCosts(Config, frozen=True):
    sleep_s: Annotated[float, doc("Seconds a shard takes to abort, drain and sleep.", ge=0)] = 0.0
    wake_s: Annotated[float, doc("Seconds a shard takes to wake.", ge=0)] = 0.0
    sync_gib_per_s: Annotated[float, doc("Weight sync bandwidth per shard, GiB/s.", gt=0)] = 2.0
    model_gib: Annotated[float, doc("Weights moved per sync, GiB.", ge=0)] = 0.0
    adapter_sync_s: Annotated[
        float,
        doc(
            "Seconds a base group's shard takes to load a member's new adapter version "
            "(only that member's new trajectories there wait; the shard serves on).",
            ge=0,
        ),
    ] = 0.5

    @property
    def sync_s(self) -> float:
        return self.model_gib / self.sync_gib_per_s


class RolloutTimes(Config, frozen=True):
    dist: Annotated[
        Literal["lognormal", "pareto", "fixed"],
        doc("Distribution of one trajectory's generation time."),
    ] = "lognormal"
    median_s: Annotated[float, doc("Median trajectory time, seconds.", gt=0)] = 60.0
    sigma: Annotated[float, doc("lognormal: sigma of the log.", ge=0)] = 1.0
    alpha: Annotated[float, doc("pareto: tail index.", gt=0)] = 1.5
    max_s: Annotated[float, doc("Trajectories are cut at this many seconds.", gt=0)] = 3600.0


class EngineCurve(Config, frozen=True):
    """How a shard's decode time grows with its batch (``simulate --engine batched``).

    One decode iteration of ``batch`` sequences holding ``context`` tokens lasts
    base_s + per_sequence_s x batch + per_context_token_s x context; a trajectory
    joining a shard is prefilled first. Rollout times keep meaning a trajectory alone
    on an idle engine; ``slots_per_shard`` caps the batch's sequences (vLLM's
    ``max_num_seqs``) and ``kv_cache_tokens``, where given, its tokens."""

    base_s: Annotated[
        float, doc("Seconds of one decode iteration, whatever its batch (weights read).", gt=0)
    ]
    per_sequence_s: Annotated[
        float, doc("Seconds each running sequence adds to an iteration.", ge=0)
    ] = 0.0
    per_context_token_s: Annotated[
        float, doc("Seconds each cached token of the batch adds to an iteration.", ge=0)
    ] = 0.0
    prefill_per_token_s: Annotated[
        float,
        doc(
            "Seconds to prefill one token (a new trajectory's prompt; a resumed one's "
            "prompt and output again); the shard decodes nothing meanwhile.",
            ge=0,
        ),
    ] = 0.0
    prompt_tokens: Annotated[
        int, doc("Prompt tokens of each trajectory (prefilled when it starts).", ge=0)
    ] = 512
    kv_cache_tokens: Annotated[
        Annotated[int, msgspec.Meta(ge=1)] | None,
        doc(
            "Tokens of K and V one shard's cache holds. A trajectory joins a shard only "
            "while every trajectory there fits at its full length (prompt and all its "
            "tokens), as vLLM's scheduler admits what its free blocks hold (it admits "
            "on the current length and preempts later: this never preempts). None: "
            "only slots_per_shard caps the batch."
        ),
    ] = None
    source: Annotated[str, doc("Where the figures come from (free text).")] = ""


class ScenarioPipeline(Config, frozen=True):
    id: PipelineId
    clusters: Annotated[
        dict[ClusterName, ClusterSpec], doc("actor_train and actor_infer, at least.")
    ]
    start_s: Annotated[float, doc("Simulated second the pipeline starts.", ge=0)] = 0.0
    steps: Annotated[int, doc("Training steps to simulate.", ge=1)] = 10
    step_target: Annotated[int, doc("Trajectories per training step.", ge=1)] = 64
    max_trajectory_age_steps: Annotated[
        int, doc("Staleness bound, as in PipelineConfig (0: on-policy).", ge=0)
    ] = 1
    slots_per_shard: Annotated[int, doc("Trajectories one shard runs at once.", ge=1)] = 16
    reprefill_s: Annotated[
        float, doc("Seconds to resume a cut trajectory elsewhere (re-prefill).", ge=0)
    ] = 0.0
    rollout: Annotated[RolloutTimes, doc("How long trajectories take.")] = RolloutTimes()
    stages: Annotated[
        dict[PriorityName, Annotated[float, msgspec.Meta(ge=0)]],
        doc(
            "Seconds per training stage, run in order on actor_train, on the number of "
            "devices actor_train declares."
        ),
    ] = msgspec.field(default_factory=lambda: {"ACTOR_TRAINING": 60.0})
    scaling: Annotated[
        dict[PriorityName, Literal["linear", "fixed"]],
        doc(
            "How a stage's time changes on fewer devices than actor_train declares (the "
            "static split gives a pipeline its slice): linear (time x declared / given, "
            "never faster than declared) or fixed. Stages not named scale linearly."
        ),
    ] = {}
    weight: Annotated[
        float,
        doc(
            "Fair-share weight among pipelines of the same priority, as in PipelineConfig "
            "(the static split divides the cluster by it too).",
            gt=0,
            le=1000,
        ),
    ] = 1.0
    base: Annotated[
        PipelineId | None,
        doc(
            "A LoRA pipeline's frozen base model: pipelines with the same base form a base "
            "group whose shards serve every member per request (same actor_infer and "
            "slots_per_shard; a weight sync loads only the adapter, adapter_sync_s)."
        ),
    ] = None

    def __post_init__(self) -> None:
        for name in ("actor_train", "actor_infer"):
            if name not in self.clusters:
                raise invalid("clusters", f"{name} is required")
        for stage in self.scaling:
            if stage not in self.stages:
                raise invalid("scaling", f"stage {stage} has no time in stages")

    def topology(self) -> dict[ClusterName, ClusterSpec]:
        return dict(self.clusters)

    @property
    def train_s(self) -> float:
        return sum(self.stages.values())

    def stages_on(self, devices: int) -> dict[PriorityName, float]:
        """Stage times on ``devices`` training devices (see ``scaling``)."""
        declared = len(self.clusters["actor_train"].devices)
        factor = declared / min(max(devices, 1), declared)
        return {
            stage: t if self.scaling.get(stage, "linear") == "fixed" else t * factor
            for stage, t in self.stages.items()
        }

    def devices(self) -> set[int]:
        return {d for c in self.clusters.values() for d in c.devices}


class Scenario(Config, frozen=True):
    cluster: Annotated[ClusterShape, doc("Nodes and devices per node.")]
    pipelines: Annotated[list[ScenarioPipeline], doc("The pipelines.", min_length=1)]
    switch: Annotated[SwitchCosts, doc("What moving a shard costs.")] = SwitchCosts()
    engine: Annotated[
        EngineCurve | None,
        doc(
            "The batching engine's curve: with it, simulate defaults to --engine batched; "
            "without, to fixed (each trajectory its own time, whatever the shard runs)."
        ),
    ] = None
    plan_interval_s: Annotated[
        float,
        doc(
            "Least simulated seconds between two plans, as SchedulerConfig.plan_interval_s "
            "(the same rules: protocols/cadence.py).",
            ge=0,
        ),
    ] = PLAN_INTERVAL_S
    progress_interval_s: Annotated[
        float,
        doc(
            "Progress alone replans at most this often, as SchedulerConfig.progress_interval_s.",
            ge=0,
        ),
    ] = PROGRESS_INTERVAL_S

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for i, p in enumerate(self.pipelines):
            if p.id in seen:
                raise invalid(f"pipelines[{i}].id", f"duplicate pipeline id {p.id!r}")
            seen.add(p.id)
            check_topology(f"pipelines[{i}].clusters", p.clusters, self.cluster)
        self._check_bases()

    def _check_bases(self) -> None:
        """Members of a base group share its shards: they must declare them alike, and a
        base is a pipeline id in the planner's snapshot, so it cannot be a pipeline's."""
        ids = {p.id for p in self.pipelines}
        first: dict[str, ScenarioPipeline] = {}
        for i, p in enumerate(self.pipelines):
            if p.base is None:
                continue
            at = f"pipelines[{i}].base"
            if p.base in ids:
                raise invalid(at, f"{p.id}'s base {p.base!r} is the id of pipeline {p.base}")
            head = first.setdefault(p.base, p)
            for key, mine, theirs in (
                ("actor_infer", p.clusters["actor_infer"], head.clusters["actor_infer"]),
                ("slots_per_shard", p.slots_per_shard, head.slots_per_shard),
            ):
                if mine != theirs:
                    raise invalid(
                        at,
                        f"{p.id}'s {key} differs from {head.id}'s, on the same base "
                        f"{p.base!r} (its members share the same shards)",
                    )

    @property
    def shape(self) -> ClusterShape:
        return self.cluster
