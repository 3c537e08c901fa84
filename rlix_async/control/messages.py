"""Wire messages of the control plane (pipeline drivers and workers <-> coordinator)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rlix_async.control.topology import ClusterName, ClusterSpec, PriorityName
from rlix_async.protocol import Message
from rlix_async.weights.cache import CacheRef

PipelineId = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[\w.\-]+$")]
Kind = Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[\w\-]+$")]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class AllocatePipelineId(Message):
    kind: Kind = "ft"


class PipelineIdReply(Message):
    pipeline_id: str


class RegisterPipeline(Message):
    pipeline_id: PipelineId
    clusters: dict[ClusterName, ClusterSpec]


class AdmitPipeline(Message):
    pipeline_id: PipelineId


class RequestStage(Message):
    """Queue a request; the grant arrives later as a Granted notification."""

    pipeline_id: PipelineId
    cluster: ClusterName
    priority: PriorityName
    step_target_estimate: NonNeg | None = None


class ReleaseStage(Message):
    pipeline_id: PipelineId
    cluster: ClusterName


class ReleaseAndRequest(Message):
    """Release one stage and queue the next in the same scheduler step."""

    pipeline_id: PipelineId
    release: ClusterName
    request: RequestStage


class ShrinkAll(Message):
    """Shrink every generation shard of this pipeline (await_release)."""

    pipeline_id: PipelineId


class ReportProgress(Message):
    pipeline_id: PipelineId
    target: NonNeg
    completed: NonNeg
    stream: str = "default"


class ClearProgress(Message):
    pipeline_id: PipelineId
    stream: str | None = None


class Unregister(Message):
    pipeline_id: PipelineId


class Resume(Message):
    """A reconnecting driver's view of its state, re-asserted after a coordinator restart."""

    pipeline_id: PipelineId
    clusters: dict[ClusterName, ClusterSpec]
    admitted: bool
    held: dict[ClusterName, PriorityName] = {}
    requests: list[RequestStage] = []


class Granted(Message):
    """Pushed to a driver: a gang stage is ready (devices) or rollout ranks changed."""

    cluster: str
    priority: str
    devices: list[int] = []
    ranks: list[int] = []


class ActiveRanks(Message):
    """Pushed to a driver whenever its awake generation ranks change."""

    cluster: str
    ranks: list[int]
    endpoints: dict[int, str] = {}  # rank -> the shard worker's data-plane endpoint


class StatusRequest(Message):
    pass


class PipelineStatus(msgspec.Struct):
    id: str
    admitted: bool
    connected: bool
    held: dict[str, str]
    active_ranks: list[int]
    remaining: int | None
    requests: list[str]


class StatusReply(Message):
    devices: int
    owners: list[str]  # per device: "" idle, "p/cluster:PRIORITY" or "p/infer[r]"
    pipelines: list[PipelineStatus]
    plans: int
    rejected_plans: int


class ShardCommand(Message):
    """Coordinator -> shard worker ``<pipeline>/infer/<rank>``.

    ``sleep``: abort, drain and sleep. ``wake``: wake, reach ``weights`` and
    serve. ``sync``: reach ``weights`` if awake (a sleeping shard syncs when it
    wakes, never before).
    """

    action: Annotated[str, msgspec.Meta(pattern=r"^(sleep|wake|sync)$")]
    weights: CacheRef | None = None


class ShardAck(Message):
    state: str
    weight_version: str | None = None


class PublishWeights(Message):
    """The owner promoted a new cached version: active shards should reach it."""

    pipeline_id: PipelineId
    ref: CacheRef
