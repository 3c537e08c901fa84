"""Wire messages of the control plane (pipeline drivers and workers <-> coordinator)."""

from __future__ import annotations

import enum
from typing import Annotated, Literal

import msgspec

from rlix_async.protocol import Message
from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.protocols.topology import ClusterName, ClusterSpec, PipelineId, PriorityName


def driver_identity(pipeline_id: str) -> str:
    """A pipeline driver's identity on the coordinator's socket."""
    return f"{pipeline_id}/driver/0"


def worker_identity(pipeline_id: str, rank: int) -> str:
    """A shard worker's identity: ``<pipeline>/infer/<rank>``."""
    return f"{pipeline_id}/infer/{rank}"


def shard_rank(identity: str) -> tuple[str, int] | None:
    """``(pipeline, rank)`` of a shard worker's identity; None for any other peer."""
    pid, role, index = [*identity.split("/"), "", "", ""][:3]
    return (pid, int(index)) if role == "infer" and index.isdigit() else None


def driver_pipeline(identity: str) -> str | None:
    """The pipeline of a driver's identity; None for any other peer."""
    pid, role = [*identity.split("/"), "", ""][:2]
    return pid if role == "driver" else None


Kind = Annotated[str, msgspec.Meta(min_length=1, max_length=32, pattern=r"^[\w\-]+$")]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
# A pipeline's fair-share weight among pipelines of the same priority (planner.py).
Weight = Annotated[float, msgspec.Meta(gt=0, le=1000)]


class AllocatePipelineId(Message):
    kind: Kind = "ft"


class PipelineIdReply(Message):
    pipeline_id: str


class RegisterPipeline(Message):
    pipeline_id: PipelineId
    clusters: dict[ClusterName, ClusterSpec]
    weight: Weight = 1.0
    # A LoRA pipeline's base group: its rollouts run on the group's shards (worker
    # identities ``<group>/infer/<rank>``), which serve every member's adapter.
    group: PipelineId | None = None


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


class ReportPace(Message):
    """The pipeline's estimate of one step alone on every device it declares
    (control/pace.py): what finish-time fairness divides its slowdown by."""

    pipeline_id: PipelineId
    exclusive_step_s: Annotated[float, msgspec.Meta(ge=1e-3, le=1e7)]


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
    weight: Weight = 1.0
    group: PipelineId | None = None
    held: dict[ClusterName, PriorityName] = {}
    requests: list[RequestStage] = []


class Granted(Message):
    """Pushed to a driver: a gang stage is ready (devices) or rollout ranks changed."""

    cluster: ClusterName
    priority: PriorityName
    devices: list[int] = []
    ranks: list[int] = []


class ActiveRanks(Message):
    """Pushed to a driver whenever its awake generation ranks change."""

    cluster: ClusterName
    ranks: list[int]
    endpoints: dict[int, str] = {}  # rank -> the shard worker's data-plane endpoint
    # rank -> the CURVE public key (z85) its tcp data plane serves with: routers
    # trust it because the coordinator, authenticated, vouches for it
    data_keys: dict[int, str] = {}


class StatusRequest(Message):
    pass


class DeviceOwner(msgspec.Struct, frozen=True):
    """Who holds a device: a gang stage (``rank`` None) or a rollout shard."""

    pipeline: str
    cluster: ClusterName
    priority: PriorityName  # GENERATION for a rollout shard
    rank: int | None = None

    def __str__(self) -> str:
        if self.rank is not None:
            return f"{self.pipeline}/{self.cluster}[{self.rank}]"
        return f"{self.pipeline}/{self.cluster}:{self.priority}"


class PipelineStatus(msgspec.Struct):
    id: str
    admitted: bool
    connected: bool
    held: dict[ClusterName, PriorityName]
    active_ranks: list[int]
    remaining: int | None
    requests: dict[ClusterName, PriorityName]  # queued, not yet granted
    shard_memory: dict[int, int] = {}  # rank -> bytes in use after its last command
    group: str | None = None  # a LoRA pipeline's base group (its shards serve it)
    members: list[str] = []  # a base group's member pipelines
    # its recent step time over its reported step alone (control/pace.py); a base
    # group's: its worst-off member's (what the planner serves it by); None: no
    # estimate, or no step ended since it started
    slowdown: float | None = None


class FenceStatus(msgspec.Struct):
    """Devices a shard worker may still hold: planned for nobody until lifted."""

    pipeline: str
    rank: int
    devices: list[int]
    holder: str | None  # worker incarnation "host:pid"
    reason: str
    age_s: float


class StatusReply(Message):
    devices: int
    owners: list[DeviceOwner | None]  # per device; None: idle
    pipelines: list[PipelineStatus]
    plans: int
    rejected_plans: int
    fenced: list[FenceStatus] = []
    stale_plans: int = 0  # out of date when the planner thread was done: planned again
    # per pipeline (or base group), the ranks of its shard workers connected now, its
    # registration or not: what a node's launcher waits for before a trainer starts
    workers: dict[str, list[int]] = {}


ShardAction = Literal["sleep", "wake", "sync", "restart"]


class ShardState(enum.StrEnum):
    """A shard worker's life: ASLEEP -> WAKING -> SYNCING -> ACTIVE -> DRAINING -> ASLEEP.

    A shard woken before any weights exist for it stays WAKING (awake, refusing
    requests) until a sync brings a version."""

    ASLEEP = "ASLEEP"
    WAKING = "WAKING"
    SYNCING = "SYNCING"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"


class ShardCommand(Message):
    """Coordinator -> shard worker ``<pipeline>/infer/<rank>``.

    ``sleep``: abort, drain and sleep. ``wake``: wake, reach ``weights`` and
    serve. ``sync``: reach ``weights`` if awake (a sleeping shard syncs when it
    wakes, never before). A base group's shard (``<group>/infer/<rank>``) gets
    ``adapters`` instead: each member's newest adapter version, loaded beside the
    others without pausing them. ``restart``: the coordinator declared it broken
    (``reason``): the worker exits for its launcher to start a new one.
    """

    action: ShardAction
    weights: CacheRef | None = None
    adapters: dict[str, CacheRef] = {}  # member pipeline -> its newest adapter
    reason: str = ""  # restart: why


class ShardAck(Message):
    state: ShardState
    weight_version: int | None = None
    adapter_versions: dict[str, int] = {}  # a base group's shard: member -> version held
    # after the command: device memory in use on the shard's devices (CUDA, via NVML),
    # or the worker's resident memory (CPU); None when the engine cannot tell
    memory_bytes: int | None = None


class PublishWeights(Message):
    """The owner promoted a new cached version: active shards should reach it."""

    pipeline_id: PipelineId
    ref: CacheRef
