"""``rlix-async bench plan``: planner latency on random realistic snapshots."""

from __future__ import annotations

import random
import time
from typing import Any

from rlix_async.bench.snapshots import random_snapshot
from rlix_async.control.plan_checks import check_plan
from rlix_async.control.planner import plan
from rlix_async.protocols.snapshot import DEFAULT_FAIRNESS, Fairness


def run_plan_bench(
    gpus: int,
    pipelines: int,
    snapshots: int = 50,
    seed: int = 0,
    fairness: Fairness = DEFAULT_FAIRNESS,
) -> dict[str, Any]:
    """Plan and check_plan latency on ``snapshots`` random snapshots under ``fairness``
    (finish_time: with the paces the coordinator would report)."""
    if gpus < 1 or pipelines < 1 or snapshots < 1:
        raise ValueError("gpus, pipelines and snapshots must be >= 1")
    rng = random.Random(seed)
    plan_ms: list[float] = []
    check_ms: list[float] = []
    for _ in range(snapshots):
        snap = random_snapshot(rng, gpus=gpus, pipelines=pipelines, fairness=fairness)
        t0 = time.perf_counter()
        result = plan(snap)
        t1 = time.perf_counter()
        violations = check_plan(snap, result)
        t2 = time.perf_counter()
        if violations:
            raise AssertionError(f"planner produced an invalid plan: {violations[:3]}")
        plan_ms.append((t1 - t0) * 1000)
        check_ms.append((t2 - t1) * 1000)
    plan_ms.sort()
    check_ms.sort()

    def pct(v: list[float], q: float) -> float:
        return v[min(len(v) - 1, round(q * (len(v) - 1)))]

    return {
        "gpus": gpus,
        "pipelines": pipelines,
        "snapshots": snapshots,
        "fairness": fairness,
        "plan_ms_p50": pct(plan_ms, 0.5),
        "plan_ms_p99": pct(plan_ms, 0.99),
        "check_ms_p50": pct(check_ms, 0.5),
    }
