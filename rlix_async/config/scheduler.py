"""The coordinator's configuration: its leases and timers, and the process's own file."""

from __future__ import annotations

from typing import Annotated

import msgspec

from rlix_async.config.schema_base import Config, Endpoint, doc
from rlix_async.protocols.cadence import PLAN_INTERVAL_S, PROGRESS_INTERVAL_S
from rlix_async.protocols.snapshot import Policy
from rlix_async.protocols.topology import ClusterShape


class SchedulerConfig(Config, frozen=True):
    lease_timeout_s: Annotated[
        float,
        doc(
            "Seconds a silent pipeline driver keeps its devices (it may be reconnecting, or "
            "its heartbeats starved by a long CPU step).",
            gt=0,
        ),
    ] = 60.0
    rebalance_s: Annotated[
        float, doc("Seconds between plans when no event asks for one (a slow timer).", gt=0)
    ] = 2.0
    progress_interval_s: Annotated[
        float,
        doc(
            "Rollout progress alone replans at most this often (moving a shard costs a "
            "sleep, a wake and a sync); requests, releases and arrivals replan at once. "
            "The simulator plans by the same rules (protocols/cadence.py).",
            ge=0,
            le=60,
        ),
    ] = PROGRESS_INTERVAL_S
    command_timeout_s: Annotated[
        float,
        doc(
            "Seconds a shard's sleep or wake may take. A sleep that fails or times out "
            "keeps its devices fenced (retried every this many seconds) until it succeeds "
            "or the worker is replaced.",
            gt=0,
        ),
    ] = 60.0
    shard_failures_before_restart: Annotated[
        int,
        doc(
            "A shard whose syncs or wakes failed this many times in a row is declared "
            "broken: the fence, the journal and `status` say why, its rank stays out of "
            "plans, and its worker is told to exit so its node's launcher starts a new "
            "one (as for a dead engine). Fewer: each failure only takes the rank out of "
            "the plan until the next.",
            ge=1,
            le=100,
        ),
    ] = 3
    sync_timeout_s: Annotated[
        float,
        doc(
            "Seconds a shard's weight sync may take (a wake that syncs gets both budgets): "
            "a 70B model moves 140 GB, which must not look like a hang.",
            gt=0,
        ),
    ] = 600.0
    plan_interval_s: Annotated[
        float,
        doc(
            "Least seconds between two plans; events meanwhile coalesce into the next. "
            "Whatever this is, a plan that took d seconds is followed by 2 d of rest.",
            ge=0,
            le=10,
        ),
    ] = PLAN_INTERVAL_S
    planner_process: Annotated[
        bool,
        doc(
            "Plan in a child process of the coordinator (true) or in a thread of it "
            "(false). A plan at 4,096 devices costs 30-50 ms of Python; in a thread it "
            "holds the GIL and the event loop's calls and heartbeats wait behind it."
        ),
    ] = True
    policy: Annotated[Policy, doc("The planner's policy (as in a snapshot).")] = Policy()


class CoordinatorConfig(Config, frozen=True):
    cluster: Annotated[ClusterShape, doc("Nodes and devices per node of the cluster.")] = (
        ClusterShape(nodes=1, gpus_per_node=8)
    )
    endpoint: Annotated[
        Endpoint | None,
        doc("Where to listen: ipc:// or tcp:// (tcp needs keys). Default: local ipc."),
    ] = None
    journal: Annotated[
        str | None, doc("Append scheduling events to this JSONL file; replayed on restart.")
    ] = None
    keys: Annotated[str | None, doc("CURVE key directory (rlix-async keygen); for tcp.")] = None
    metrics_port: Annotated[
        Annotated[int, msgspec.Meta(ge=1, le=65535)] | None,
        doc("Serve Prometheus metrics on this port (of metrics_host)."),
    ] = None
    metrics_host: Annotated[
        str,
        doc(
            "Address the metrics server binds: loopback by default, since the metrics "
            "name every pipeline; 0.0.0.0 opens them to the network (no authentication).",
            min_length=1,
        ),
    ] = "127.0.0.1"
    heartbeat_interval_s: Annotated[
        float, doc("Heartbeat period; a peer silent 2.5 periods is dead.", gt=0)
    ] = 1.0
    io_threads: Annotated[
        int,
        doc(
            "ZMQ I/O threads of the coordinator's socket; its connections are spread over"
            " them (at 4,096 peers two halved the calls' p99 against one: docs/PERF.md).",
            ge=1,
            le=16,
        ),
    ] = 2
    scheduler: Annotated[SchedulerConfig, doc("Leases, timers and timeouts.")] = SchedulerConfig()
