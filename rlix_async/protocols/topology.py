"""Pipeline topology: named clusters of devices split into tensor-parallel bundles.

Vocabulary follows RLix: a pipeline declares clusters ``actor_train``,
``actor_infer`` (required), ``critic`` and ``reference``, each with a TP size and
a device list. Data-parallel rank ``r`` of a cluster is the bundle
``devices[r*tp:(r+1)*tp]``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Annotated, Literal, NamedTuple

import msgspec

CLUSTER_NAMES = ("actor_train", "actor_infer", "critic", "reference")
ClusterName = Literal["actor_train", "actor_infer", "critic", "reference"]
INFER: ClusterName = "actor_infer"
TRAIN: ClusterName = "actor_train"
SMALL_TP = (1, 2, 4, 8)
PipelineId = Annotated[
    str,
    msgspec.Meta(
        min_length=1,
        max_length=64,
        pattern=r"^[\w.\-]+$",
        description="Pipeline id: letters, digits, '.', '_' or '-'.",
    ),
]


class Priority(enum.IntEnum):
    """Lower is more important; only GENERATION is preemptable."""

    INITIALIZATION = 0
    ACTOR_TRAINING = 1
    CRITIC_TRAINING = 2
    OLD_LOG_PROBS = 3
    REF_LOG_PROBS = 4
    VALUE_COMPUTE = 5
    GENERATION = 6


PriorityName = Literal[
    "INITIALIZATION",
    "ACTOR_TRAINING",
    "CRITIC_TRAINING",
    "OLD_LOG_PROBS",
    "REF_LOG_PROBS",
    "VALUE_COMPUTE",
    "GENERATION",
]


def priority_name(priority: Priority) -> PriorityName:
    """The wire name of a priority (``Priority.GENERATION`` -> ``"GENERATION"``)."""
    return priority.name  # type: ignore[return-value]  # the names are PriorityName's


class TopologyError(ValueError):
    """A topology that breaks a placement rule; the message names cluster and rule."""


class ClusterShape(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nodes: Annotated[int, msgspec.Meta(ge=1, description="Nodes in the cluster.")]
    gpus_per_node: Annotated[
        int, msgspec.Meta(ge=1, description="Devices per node (device d is on node d // this).")
    ]

    @property
    def num_devices(self) -> int:
        return self.nodes * self.gpus_per_node


# What a launcher tells each node's torchrun job of a trainer spanning nodes: the
# global rank of its first local rank, the ranks in all, and the node's address (its
# collective links use the interface holding it).
SPAN_FIRST_RANK = "RLIX_TRAINER_FIRST_RANK"
SPAN_WORLD = "RLIX_TRAINER_WORLD"
SPAN_ADDRESS = "RLIX_NODE_ADDRESS"


class ClusterSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tp: Annotated[
        int, msgspec.Meta(ge=1, description="Tensor-parallel size: devices per rank (bundle).")
    ] = 1
    devices: Annotated[
        tuple[Annotated[int, msgspec.Meta(ge=0)], ...],
        msgspec.Meta(description="Global device ids, sorted; rank r is devices[r*tp:(r+1)*tp]."),
    ] = ()
    pp: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="Pipeline-parallel size (actor_train, megatron backend): stages per "
            "model replica; a replica spans tp x pp devices.",
        ),
    ] = 1
    ep: Annotated[
        int,
        msgspec.Meta(
            ge=1,
            description="Expert-parallel size (actor_train, megatron backend, "
            "mixture-of-experts models): each replica of a stage holds experts/ep of every "
            "MoE layer's experts; a layout spans tp x pp x ep devices (ranks in "
            "Megatron's tp-ep-dp-pp order: a stage's ranks are consecutive).",
        ),
    ] = 1

    @property
    def dp(self) -> int:
        """Bundles of ``tp`` devices (ranks as the planner counts them; a trainer's
        data-parallel size is this divided by ``pp``, its experts' by ``pp`` x ``ep``)."""
        return len(self.devices) // self.tp

    def bundle(self, rank: int) -> tuple[int, ...]:
        return self.devices[rank * self.tp : (rank + 1) * self.tp]

    def bundles(self) -> list[tuple[int, ...]]:
        return [self.bundle(r) for r in range(self.dp)]

    def ranks_clear_of(self, devices: Iterable[int]) -> int:
        """How many of its ranks use none of ``devices`` (a rollout's ranks that run on
        while its training holds its own devices)."""
        taken = set(devices)
        return sum(1 for b in self.bundles() if taken.isdisjoint(b))


class TrainerPlace(NamedTuple):
    """Where a trainer rank sits in the model's layout: its tensor-parallel rank, its
    pipeline stage, its expert-parallel rank, its replica (data-parallel rank) and its
    expert replica (expert-data-parallel rank: the replicas of its experts)."""

    tp: int
    pp: int
    ep: int
    dp: int
    edp: int


def trainer_place(rank: int, world: int, tp: int, pp: int, ep: int = 1) -> TrainerPlace:
    """Megatron's rank order for ``world`` ranks at ``tp`` x ``pp`` (x ``ep``). Without
    expert parallel it is tp-pp-dp: ``tp`` consecutive ranks per stage, ``tp`` x ``pp``
    per replica. With it, tp-ep-dp-pp (Megatron's default order): a stage's ranks are
    consecutive, so the experts' all-to-all stays within them (on one node where a
    stage fits) and only pipeline traffic crosses; replica d holds expert slice
    ``d % ep``. Megatron allows no order with both consecutive replicas and experts
    split over replicas at pp > 1 (``initialize_model_parallel``)."""
    dp_world = world // (tp * pp)
    if ep == 1:
        d = rank // (tp * pp)
        return TrainerPlace(rank % tp, rank // tp % pp, 0, d, d)
    d = rank // tp % dp_world
    return TrainerPlace(rank % tp, rank // (tp * dp_world), d % ep, d, d // ep)


def _layout_sizes(spec: ClusterSpec) -> str:
    """The sizes a device count must be a multiple of: ``tp=2``, ``tp x pp = 2 x 2`` or
    ``tp x pp x ep = 1 x 2 x 2``, naming pp and ep only where set, so a rollout
    cluster's message speaks of its tp alone."""
    if spec.ep > 1:
        return f"tp x pp x ep = {spec.tp} x {spec.pp} x {spec.ep}"
    return f"tp x pp = {spec.tp} x {spec.pp}" if spec.pp > 1 else f"tp={spec.tp}"


def validate_cluster(name: str, spec: ClusterSpec, shape: ClusterShape) -> None:
    gpn = shape.gpus_per_node
    where = f"cluster {name}"
    if name not in CLUSTER_NAMES:
        raise TopologyError(f"{where}: unknown cluster name (expected one of {CLUSTER_NAMES})")
    if name == "actor_train":  # a trainer's tensor-parallel group lives on one node
        if spec.tp > gpn:
            raise TopologyError(
                f"{where}: tp={spec.tp} > gpus_per_node={gpn}: a trainer's tensor-parallel "
                "group must fit one node"
            )
    elif spec.pp != 1:
        raise TopologyError(f"{where}: pp={spec.pp}: pipeline parallel is actor_train's only")
    elif spec.ep != 1:
        raise TopologyError(f"{where}: ep={spec.ep}: expert parallel is actor_train's only")
    elif spec.tp not in SMALL_TP and spec.tp % gpn != 0:
        raise TopologyError(
            f"{where}: tp={spec.tp} must be in {SMALL_TP} or a multiple of gpus_per_node={gpn}"
        )
    if not spec.devices:
        raise TopologyError(f"{where}: device list is empty")
    if list(spec.devices) != sorted(set(spec.devices)):
        raise TopologyError(f"{where}: devices must be sorted and unique, got {list(spec.devices)}")
    bad = [d for d in spec.devices if not 0 <= d < shape.num_devices]
    if bad:
        raise TopologyError(
            f"{where}: devices {bad} do not exist (cluster has {shape.num_devices}: "
            f"{shape.nodes} nodes x {gpn})"
        )
    if len(spec.devices) % (spec.tp * spec.pp * spec.ep):
        raise TopologyError(
            f"{where}: {len(spec.devices)} devices is not a multiple of {_layout_sizes(spec)}"
        )
    for rank, bundle in enumerate(spec.bundles()):
        if bundle[-1] - bundle[0] != len(bundle) - 1:
            raise TopologyError(f"{where}: TP bundle {rank} {list(bundle)} is not contiguous")
        if spec.tp <= gpn:
            if bundle[0] // gpn != bundle[-1] // gpn:
                raise TopologyError(
                    f"{where}: TP bundle {rank} {list(bundle)} crosses a node boundary "
                    f"(gpus_per_node={gpn})"
                )
        elif bundle[0] % gpn:
            raise TopologyError(
                f"{where}: TP bundle {rank} {list(bundle)} spans nodes but does not start "
                f"on a node boundary (gpus_per_node={gpn})"
            )


def validate_topology(
    clusters: Mapping[ClusterName, ClusterSpec], shape: ClusterShape, *, member: bool = False
) -> None:
    """Raise :class:`TopologyError` naming the cluster and rule that is broken. A base
    group's member (``member``) has its rollouts on the group's shards: in a planner
    snapshot it declares no actor_infer; anywhere else, one is required."""
    if member and INFER in clusters:
        raise TopologyError(f"cluster {INFER} is its base group's, not a member's")
    if not member and INFER not in clusters:
        raise TopologyError(f"cluster {INFER} is required (declared: {sorted(clusters)})")
    for name, spec in clusters.items():
        validate_cluster(name, spec, shape)
