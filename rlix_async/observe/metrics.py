"""Prometheus gauges for ``metrics_port``, set from the coordinator's ``StatusReply``."""

from __future__ import annotations

from collections import Counter

from rlix_async.protocols.messages import StatusReply


class Metrics:
    """Its own registry, so several coordinators in one process (tests) do not collide."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        from prometheus_client import CollectorRegistry, Gauge, start_http_server

        self.registry = CollectorRegistry()
        self.devices = Gauge(
            "rlix_devices_held", "devices held", ["pipeline", "stage"], registry=self.registry
        )
        self.plans = Gauge("rlix_plans_applied", "plans applied", registry=self.registry)
        self.rejected = Gauge(
            "rlix_plans_rejected", "plans refused by the validator", registry=self.registry
        )
        self.pipelines = Gauge("rlix_pipelines", "pipelines registered", registry=self.registry)
        self.fenced = Gauge(
            "rlix_devices_fenced",
            "devices a shard worker may still hold (sleep unconfirmed or worker lost)",
            registry=self.registry,
        )
        self.shard_memory = Gauge(
            "rlix_shard_memory_bytes",
            "memory in use on a shard's devices after its last command (RSS on CPU)",
            ["pipeline", "rank"],
            registry=self.registry,
        )
        self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)

    def update(self, status: StatusReply) -> None:
        self.plans.set(status.plans)
        self.rejected.set(status.rejected_plans)
        self.pipelines.set(len(status.pipelines))
        self.devices.clear()
        held = Counter((o.pipeline, o.priority) for o in status.owners if o is not None)
        for (pid, stage), n in held.items():
            self.devices.labels(pid, stage).set(n)
        self.fenced.set(len({d for f in status.fenced for d in f.devices}))
        self.shard_memory.clear()
        for p in status.pipelines:
            for rank, used in p.shard_memory.items():
                self.shard_memory.labels(p.id, str(rank)).set(used)

    def close(self) -> None:
        self.server.shutdown()
