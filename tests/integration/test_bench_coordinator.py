"""`rlix-async bench coordinator` at a tiny size: a real coordinator process, simulated
shard peers and real pipeline clients on real sockets, through the CLI."""

from __future__ import annotations

import json

import pytest
from helpers.cluster import rlix

from rlix_async.bench.coordinator import layout


def test_bench_coordinator_runs_the_cycle_and_reports_its_fields() -> None:
    run = rlix(
        *("bench", "coordinator", "--json", "--peers", "32", "--pipelines", "4"),
        *("--duration", "3", "--warmup", "1", "--step-s", "2", "--shard-delay-ms", "20"),
        timeout=90,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    r = json.loads(run.stdout)
    for key in (
        "p50_ms",
        "p99_ms",
        "false_dead",
        "coord_cpu_pct",
        "coord_rss_mb",
        "plans_per_s",
        "loop_lag_ms",
        "grant_wait",
        "goals",
    ):
        assert key in r, key
    assert r["false_dead"] == 0
    assert r["calls"] > 0 and r["p50_ms"] > 0  # drivers' control calls were timed
    assert r["by_call"].keys() <= {"RequestStage", "ReleaseStage", "PublishWeights"}
    assert r["plans_per_s"] > 0 and r["coord_rss_mb"] > 0
    assert sum(r["shard_commands"].values()) > 0  # the peers were told to wake and sleep
    assert r["coordinator_errors"] == 0, r["coordinator_error_lines"]


def test_layout_shares_every_device_between_two_rollouts_and_one_trainer() -> None:
    pipes = layout(32, 4)
    uses: dict[int, list[str]] = {}
    for pid, clusters in pipes.items():
        assert len(clusters["actor_infer"]["devices"]) == 16  # its block and the next one
        assert set(clusters["actor_train"]["devices"]) < set(clusters["actor_infer"]["devices"])
        for d in clusters["actor_infer"]["devices"]:
            uses.setdefault(d, []).append(pid)
    assert sorted(uses) == list(range(32)) and all(len(u) == 2 for u in uses.values())
    with pytest.raises(ValueError, match="multiple"):
        layout(30, 4)
