"""The configuration of a whole launch: its pipelines, cluster, engine and scheduler,
checked together (config/launch_rules.py) before any process starts."""

from __future__ import annotations

from typing import Annotated

from rlix_async.config.engine import EngineConfig, VllmEngineConfig
from rlix_async.config.launch_rules import check_launch
from rlix_async.config.pipeline import PipelineConfig
from rlix_async.config.scheduler import SchedulerConfig
from rlix_async.config.schema_base import Config, doc
from rlix_async.protocols.topology import ClusterShape


class LaunchConfig(Config, frozen=True):
    pipelines: Annotated[list[PipelineConfig], doc("The pipelines to run.", min_length=1)]
    out: Annotated[str, doc("Output directory: journal, logs, one directory per pipeline.")] = (
        "rlix-out"
    )
    cluster: Annotated[ClusterShape, doc("Nodes and devices per node.")] = ClusterShape(
        nodes=1, gpus_per_node=4
    )
    engine: Annotated[EngineConfig, doc("Every shard worker's inference engine.")] = (
        VllmEngineConfig()
    )
    scheduler: Annotated[SchedulerConfig, doc("The coordinator's leases and timers.")] = (
        SchedulerConfig()
    )
    heartbeat_interval_s: Annotated[
        float,
        doc(
            "The coordinator's and every shard's heartbeat period: a process silent 2.5 "
            "periods is declared dead, and every process adopts the longer wait from the "
            "welcome of the server it joins. "
            "Raise it where hosts are loaded enough to starve a process for seconds.",
            gt=0,
            le=60,
        ),
    ] = 1.0
    node_addresses: Annotated[
        list[str] | None,
        doc(
            "Each node's address as the other nodes reach it, node 0 first (`launch "
            "--node K --address` must be entry K). Needed when a trainer's actor_train "
            "devices span nodes: its ranks on other nodes find rank 0's store there."
        ),
    ] = None
    trainer_port: Annotated[
        int,
        doc(
            "A trainer spanning nodes serves its ranks' sealed store on its first node's "
            "address at this port plus the pipeline's index in `pipelines`.",
            ge=1024,
            le=65000,
        ),
    ] = 29700

    def __post_init__(self) -> None:
        check_launch(self.pipelines, self.cluster, self.engine, self.node_addresses)
