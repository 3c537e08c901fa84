"""`rlix-async bench coordinator` at a tiny size: a real coordinator process, simulated
shard peers and real pipeline clients on real sockets, through the CLI."""

from __future__ import annotations

import json
import os

import pytest
from helpers.cluster import rlix

from rlix_async.bench.coordinator import layout
from rlix_async.bench.coordinator_report import split_calls


# 32 peer processes and 4 drivers heartbeating against a pinned coordinator: beside a
# heavy test on the other core (a torchrun job, vLLM engines) a peer was once silent
# past the timeout and counted as falsely dead, the bench's own goal. In the heavy
# group it runs beside light tests only.
@pytest.mark.slow
def test_bench_coordinator_runs_the_cycle_and_reports_its_fields() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--coordinator-cpus", str(cpus[-1])] if len(cpus) > 1 else []
    run = rlix(
        *("bench", "coordinator", "--json", "--peers", "32", "--pipelines", "4"),
        *("--duration", "3", "--warmup", "1", "--step-s", "2", "--shard-delay-ms", "20"),
        *pin,
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
    # every call was found in the coordinator's handler log, so its round trip splits
    assert r["call_split"]["matched"] == r["calls"]
    assert r["received_per_s"] > 0 and r["reader_turn_ms"]["n"] > 0
    if pin:
        assert r["coordinator_cpus"] == [cpus[-1]]


def test_bench_coordinator_refuses_cpus_it_cannot_pin() -> None:
    every = ",".join(map(str, sorted(os.sched_getaffinity(0))))  # none left for the load
    for bad in (every, "x", "9999"):
        run = rlix("bench", "coordinator", "--coordinator-cpus", bad, timeout=30)
        assert run.returncode == 2, run.stderr
        assert "--coordinator-cpus" in run.stderr and "Traceback" not in run.stderr


def test_a_call_splits_into_before_during_and_after_its_handler() -> None:
    """Matched by type and pipeline to the handler run that began inside the call."""
    calls = [
        ["ReleaseStage", 10.0, 0.100, "p1"],  # handler 10.060-10.061: 60 + 1 + 39 ms
        ["ReleaseStage", 10.0, 0.010, "p2"],  # p2's handler began after its reply: no match
        ["RequestStage", 11.0, 0.020, "p1"],
    ]
    handled = {
        "ReleaseStage": [["p1", 10.060, 10.061], ["p2", 10.5, 10.501], ["p1", 9.0, 9.001]],
        "RequestStage": [["p1", 11.005, 11.006]],
    }
    out = split_calls(calls, handled)
    assert out["matched"] == 2
    assert out["before_handler"]["max_ms"] == pytest.approx(60.0)
    assert out["handler"]["max_ms"] == pytest.approx(1.0)
    assert out["after_handler"]["max_ms"] == pytest.approx(39.0)
    slowest = out["slowest"]  # the slowest 1%: here the one slowest call
    assert slowest["round_trip_ms"] == pytest.approx(100.0)
    assert slowest["before_ms"] + slowest["handler_ms"] + slowest["after_ms"] == pytest.approx(
        100.0
    )


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
