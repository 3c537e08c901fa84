"""The planner's contract: the cluster snapshot it reads and the plan it returns.

Documented in docs/SCHEDULING.md (the JSON format of ``rlix-async plan``).
The coordinator builds a :class:`Snapshot` from its registry, the simulator
from its own, and ``rlix-async plan`` from a file (:func:`decode_snapshot`
validates it fully).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from rlix_async.protocols.topology import (
    INFER,
    ClusterName,
    ClusterShape,
    ClusterSpec,
    PipelineId,
    PriorityName,
    TopologyError,
    validate_topology,
)

# --- snapshot (input) ---------------------------------------------------------------


NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Fairness = Literal["finish_time", "demand"]  # Policy.fairness
DEFAULT_FAIRNESS: Fairness = "finish_time"


class RequestIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    seq: NonNeg
    cluster: ClusterName
    priority: PriorityName
    step_target_estimate: NonNeg | None = None
    age_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0


class ProgressIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    target: NonNeg
    completed: NonNeg
    stream: str = "default"


class PipelineIn(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    id: PipelineId
    clusters: dict[ClusterName, ClusterSpec]
    held: dict[ClusterName, PriorityName] = {}
    active_ranks: dict[ClusterName, list[NonNeg]] = {}
    # Ranks never to start: their shard worker died and has not come back.
    offline_ranks: dict[ClusterName, list[NonNeg]] = {}
    progress: ProgressIn | list[ProgressIn] | None = None
    requests: list[RequestIn] = []
    # Fair-share weight among pipelines of the same priority: rollout shares go by
    # weight x remaining trajectories.
    weight: Annotated[float, msgspec.Meta(gt=0, le=1000)] = 1.0
    # A LoRA pipeline's base group (docs/SCHEDULING.md, "Base groups"): the pipeline,
    # in this snapshot, whose shards serve its rollouts. It then declares no
    # actor_infer itself, and its rollout demand is counted in the group's progress.
    base_group: PipelineId | None = None
    # Finish-time fairness (Policy.fairness): its recent step time over its estimated
    # step time alone on every device it declares (None: not known yet), and how long
    # its rollout progress has stood still while it had trajectories to generate.
    slowdown: Annotated[float, msgspec.Meta(gt=0)] | None = None
    stalled_s: Annotated[float, msgspec.Meta(ge=0)] = 0.0

    def remaining(self) -> int | None:
        """Trajectories still to generate this step; None when never reported."""
        if self.progress is None:
            return None
        streams = self.progress if isinstance(self.progress, list) else [self.progress]
        return sum(p.target - min(p.completed, p.target) for p in streams)


class Policy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    aging_s: Annotated[
        float,
        msgspec.Meta(
            gt=0, description="A gang request waiting this long is served before every fresh one."
        ),
    ] = 120.0
    fairness: Annotated[
        Fairness,
        msgspec.Meta(
            description=(
                "How rollout devices are divided among pipelines of one priority. "
                "finish_time: the pipeline slowed most against its own pace alone gets "
                "the most (Themis); when bundles run short, a pipeline ahead of its pace "
                "gives its one up once every larger share is down to one, and a starving "
                "one gets one back. demand: by weight x remaining trajectories, a bundle "
                "for every pipeline with demand."
            )
        ),
    ] = DEFAULT_FAIRNESS
    starvation_s: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            description=(
                "Under finish_time, a pipeline whose rollout progress stood still this "
                "long while it had trajectories to generate is owed one bundle again."
            ),
        ),
    ] = 300.0


class Snapshot(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    cluster: ClusterShape
    pipelines: list[PipelineIn]
    policy: Policy = Policy()
    # Devices nobody owns that a shard worker may still hold (its sleep is not
    # confirmed, or it vanished and has not been replaced): never planned for anyone.
    fenced: list[NonNeg] = []


class SnapshotError(ValueError):
    """An inconsistent snapshot; the message names the offending field."""


# --- plan (output) -----------------------------------------------------------------


class Grant(msgspec.Struct, frozen=True):
    pipeline: str
    cluster: ClusterName
    priority: PriorityName
    devices: list[int]


class RankChange(msgspec.Struct, frozen=True):
    pipeline: str
    cluster: ClusterName
    ranks: list[int]


class Waiting(msgspec.Struct, frozen=True):
    pipeline: str
    cluster: ClusterName
    reason: str


class Plan(msgspec.Struct):
    grants: list[Grant] = []
    shrink: list[RankChange] = []
    expand: list[RankChange] = []
    waiting: list[Waiting] = []
    idle_devices: list[int] = []


# --- snapshot loading and validation --------------------------------------------------


def decode_snapshot(data: bytes | str) -> Snapshot:
    """Parse and fully validate a JSON snapshot (raises SnapshotError)."""
    try:
        snap = msgspec.json.decode(data, type=Snapshot)
    except msgspec.ValidationError as exc:
        raise SnapshotError(str(exc)) from None
    except msgspec.DecodeError as exc:
        raise SnapshotError(f"not valid JSON: {exc}") from None
    validate_snapshot(snap)
    return snap


def validate_snapshot(snap: Snapshot) -> None:
    owner: dict[int, str] = {}
    seen_ids: set[str] = set()
    seen_seq: dict[int, str] = {}

    def claim(devs: tuple[int, ...], who: str, where: str) -> None:
        for d in devs:
            if d in owner:
                raise SnapshotError(f"{where}: device {d} is also held by {owner[d]}")
            owner[d] = who

    for d in snap.fenced:
        if d >= snap.cluster.num_devices:
            raise SnapshotError(f"$.fenced: device {d} does not exist")
        claim((d,), "a fence", "$.fenced")
    for i, p in enumerate(snap.pipelines):
        at = f"$.pipelines[{i}]"
        if p.id in seen_ids:
            raise SnapshotError(f"{at}.id: duplicate pipeline id {p.id!r}")
        seen_ids.add(p.id)
        try:
            validate_topology(dict(p.clusters), snap.cluster, member=p.base_group is not None)
        except TopologyError as exc:
            raise SnapshotError(f"{at}.clusters: {exc}") from None
        if p.base_group is not None:
            _check_base_group(snap, p, at)
        for cname, prio in p.held.items():
            if cname not in p.clusters:
                raise SnapshotError(f"{at}.held.{cname}: cluster not declared")
            if prio == "GENERATION":
                raise SnapshotError(f"{at}.held.{cname}: generation is held via active_ranks")
            claim(p.clusters[cname].devices, f"{p.id}/{cname}", f"{at}.held.{cname}")
        for cname, ranks in p.active_ranks.items():
            if cname != INFER:
                raise SnapshotError(f"{at}.active_ranks.{cname}: only {INFER} has generation ranks")
            spec = p.clusters[INFER]
            if len(set(ranks)) != len(ranks):
                raise SnapshotError(f"{at}.active_ranks.{cname}: duplicate ranks {ranks}")
            for r in ranks:
                if r >= spec.dp:
                    raise SnapshotError(
                        f"{at}.active_ranks.{cname}: rank {r} out of range (dp={spec.dp})"
                    )
                claim(spec.bundle(r), f"{p.id}/{INFER}[{r}]", f"{at}.active_ranks.{cname}")
        for cname, ranks in p.offline_ranks.items():
            if cname != INFER or INFER not in p.clusters:
                raise SnapshotError(f"{at}.offline_ranks.{cname}: only {INFER} has shard ranks")
            bad = [r for r in ranks if r >= p.clusters[INFER].dp]
            if bad:
                raise SnapshotError(f"{at}.offline_ranks.{cname}: ranks {bad} out of range")
        open_clusters: set[str] = set()
        for j, req in enumerate(p.requests):
            rat = f"{at}.requests[{j}]"
            if req.seq in seen_seq:
                raise SnapshotError(f"{rat}.seq: {req.seq} already used by {seen_seq[req.seq]}")
            seen_seq[req.seq] = f"{p.id}"
            if req.cluster not in p.clusters:
                raise SnapshotError(f"{rat}.cluster: {req.cluster} is not declared by {p.id}")
            if (req.priority == "GENERATION") != (req.cluster == INFER) and req.priority != (
                "INITIALIZATION"
            ):
                raise SnapshotError(
                    f"{rat}: GENERATION is requested on {INFER} and only there (got "
                    f"{req.priority} on {req.cluster})"
                )
            if req.cluster in open_clusters:
                raise SnapshotError(f"{rat}.cluster: a second open request for {req.cluster}")
            if req.cluster in p.held:
                raise SnapshotError(f"{rat}.cluster: {p.id} already holds {req.cluster}")
            open_clusters.add(req.cluster)


def _check_base_group(snap: Snapshot, p: PipelineIn, at: str) -> None:
    """A member names a group in the snapshot that owns actor_infer and is no member."""
    base = next((q for q in snap.pipelines if q.id == p.base_group), None)
    if base is None or INFER not in base.clusters or base.base_group is not None:
        raise SnapshotError(
            f"{at}.base_group: {p.base_group!r} is no pipeline with {INFER} in this snapshot"
        )
    if p.active_ranks or p.offline_ranks:
        raise SnapshotError(f"{at}: a base group member's shard ranks are its group's")
