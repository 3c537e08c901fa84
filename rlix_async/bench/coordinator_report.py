"""`rlix-async bench coordinator`'s report: a call's round trip split around its
handler, and the result as text."""

from __future__ import annotations

import bisect
import math
from typing import Any


def _pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def ms(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": round(1000 * _pct(values, 50), 2),
        "p99_ms": round(1000 * _pct(values, 99), 2),
        "max_ms": round(1000 * max(values, default=0.0), 2),
    }


def split_calls(calls: list[list[Any]], handled: dict[str, list[list[Any]]]) -> dict[str, Any]:
    """Each driver call's round trip in three: from its send to the coordinator's
    handler (the driver's and coordinator's ZMQ threads, the coordinator's socket
    queue and loop), the handler, and from the handler back to the driver's await.
    A call is matched to the handler run of its type and pipeline that began inside
    it; ``slowest`` splits the slowest 1% the same way."""
    entered: dict[tuple[str, str], list[list[Any]]] = {}
    for name, rows in handled.items():
        for pid, t_in, t_out in rows:
            entered.setdefault((name, pid), []).append([t_in, t_out])
    for runs in entered.values():
        runs.sort()
    parts: list[tuple[float, float, float, float]] = []  # (round trip, before, in, after)
    for name, t0, dt, pid in calls:
        runs = entered.get((name, pid), [])
        i = bisect.bisect_left(runs, [t0])
        if i < len(runs) and runs[i][0] <= t0 + dt:
            t_in, t_out = runs[i]
            parts.append((dt, t_in - t0, t_out - t_in, t0 + dt - t_out))
    parts.sort()
    slowest = parts[-max(1, len(parts) // 100) :] if parts else []
    return {
        "matched": len(parts),
        "before_handler": ms([p[1] for p in parts]),
        "handler": ms([p[2] for p in parts]),
        "after_handler": ms([p[3] for p in parts]),
        "slowest": {
            k: round(1000 * sum(p[i] for p in slowest) / len(slowest), 2) if slowest else 0.0
            for i, k in enumerate(["round_trip_ms", "before_ms", "handler_ms", "after_ms"])
        },
    }


def format_result(r: dict[str, Any]) -> str:
    if "setup_failed" in r:
        return (
            f"coordinator at {r['peers']} shard peers + {r['pipelines']} pipelines: the cluster "
            f"never came up ({r['setup_failed']}, after {r['setup_s']:.0f} s); "
            f"{r['false_dead']} peers declared dead"
        )
    g, sch, lag, snp = r["grant_wait"], r["schedule_ms"], r["loop_lag_ms"], r["snapshot_ms"]
    lines = [
        f"coordinator at {r['peers']} shard peers + {r['pipelines']} pipelines "
        f"({r['devices']} devices), {r['duration_s']:.0f} s after a {r['warmup_s']:.0f} s "
        f"warm-up (setup {r['setup_s']:.1f} s)",
        f"  control calls  {r['calls']:6d}  p50 {r['p50_ms']:7.2f} ms  p99 {r['p99_ms']:7.2f} ms"
        f"  max {r['max_ms']:7.2f} ms",
    ]
    lines += [
        f"    {name:18s} {row['n']:6d}  p50 {row['p50_ms']:7.2f} ms  p99 {row['p99_ms']:7.2f} ms"
        for name, row in r["by_call"].items()
    ]
    cs = r["call_split"]
    lines.append(
        f"    split p99: before the handler {cs['before_handler']['p99_ms']:.1f} ms, in it "
        f"{cs['handler']['p99_ms']:.1f} ms, after it {cs['after_handler']['p99_ms']:.1f} ms "
        f"(slowest 1%: {cs['slowest']['before_ms']:.0f} / {cs['slowest']['handler_ms']:.0f} / "
        f"{cs['slowest']['after_ms']:.0f} ms)"
    )
    lines += [
        f"  grant wait     {g['n']:6d}  p50 {g['p50_ms']:7.1f} ms  p99 {g['p99_ms']:7.1f} ms"
        "  (training request to grant; shrinks included)",
        f"  false_dead     {r['false_dead']}  (a peer's longest heartbeat gap "
        f"{r['peer_hb_gap_max_s']:.2f} s; the coordinator's longest silence to a peer "
        f"{r['server_gap_max_s']:.2f} s)",
        f"  coordinator    CPU {r['coord_cpu_pct']:.0f}% of a core (event loop thread "
        f"{r['coord_loop_cpu_pct']:.0f}%), RSS {r['coord_rss_mb']:.0f} MiB"
        f"  (peers {r['peers_cpu_pct']:.0f}%, drivers {r['drivers_cpu_pct']:.0f}%)",
        f"  planning       {r['plans_per_s']:.1f} plans/s ({r['applied_plans_per_s']}/s changed "
        f"something, {r['stale_plans']} out of date); plan p50 {r['plan_ms']['p50_ms']:.1f} ms "
        f"(the planner process: {r['planner_process_cpu_pct']:.0f}% of a core; in the thread: "
        f"{r['plan_cpu_pct']:.0f}%); on the loop: check+apply p50 {sch['p50_ms']:.1f} ms p99 {sch['p99_ms']:.1f} ms, "
        f"snapshot p50 {snp['p50_ms']:.1f} ms p99 {snp['p99_ms']:.1f} ms",
        f"  reader         {r['received_per_s']} messages/s, a turn p99 "
        f"{r['reader_turn_ms']['p99_ms']:.1f} ms max {r['reader_turn_ms']['max_ms']:.1f} ms",
        f"  loop lag       p50 {lag['p50_ms']:.1f} ms  p99 {lag['p99_ms']:.1f} ms  "
        f"max {lag['max_ms']:.1f} ms; full GC {r['gc_full_ms']['n']}x, max "
        f"{r['gc_full_ms']['max_ms']:.0f} ms; drivers' loops p99 "
        f"{r['driver_loop_lag_ms']['p99_ms']:.1f} ms",
        f"  load           {r['steps']} steps, {r['progress_per_s']:.0f} progress reports/s, "
        f"shard commands {r['shard_commands']}",
        "  goals          "
        + ", ".join(f"{k}: {'met' if ok else 'MISSED'}" for k, ok in r["goals"].items()),
    ]
    return "\n".join(lines)
