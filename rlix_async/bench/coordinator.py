"""``rlix-async bench coordinator``: the control plane at cluster scale, on real sockets.

One coordinator process (the shipped ``control.coordinator_main.serve``, with timers
around its scheduling step: rlix_async/bench/cluster_load.py), ``--peers``
simulated shard workers spread over a few processes (one DEALER socket each,
heartbeating at the default interval, answering every sleep/wake/sync) and
``--pipelines`` drivers on the real client library in one or two processes.
The drivers run the RLix cycle for ``--warmup`` + ``--duration`` seconds:
rollout progress in 2% buckets, ACTOR_TRAINING requested, held, released, new
weights published (which syncs the awake shards).

Layout (as ``scenarios/stress_4096.yaml``): ``peers`` devices, 8 per node; each
pipeline owns a block of ``peers / pipelines`` devices, rolls out on its own
block and its neighbour's with TP-2 shards (so one shard peer per device) and
trains on the first half of its own block. Every device is in two pipelines'
rollout clusters and one training cluster: pipelines compete everywhere.

What is measured, in the window after the warm-up:

- ``p50_ms``/``p99_ms``: the round trip of every control call the drivers make
  (RequestStage, ReleaseStage, PublishWeights: request out, reply in), timed in
  the client. ``grant_wait_ms``: from a training request to its grant, which
  includes shrinking the shards on its devices (scheduling, not RPC).
- ``false_dead``: peers the coordinator declared dead ("declared dead" in its
  log) although every peer process was alive; ``peer_hb_gap_max_s`` shows whether
  a peer process itself was too starved to beat (a true positive then).
- coordinator CPU (% of one core) and RSS, from /proc via psutil.
- ``plans_per_s``: planner runs; ``applied_plans_per_s``: plans that changed
  something (status ``plans``); ``plan_cpu_pct``: the planner's CPU time over the
  window (% of a core) when the coordinator plans in its thread, and
  ``planner_process_cpu_pct`` when it plans in its planner process (the
  default; ``plan_ms`` is then the round trip to it); ``schedule_ms``: the
  part of a scheduling step on the event loop (``_carry_out``: check and apply) and
  ``snapshot_ms`` the registry snapshots it takes (two per step);
  ``loop_lag_ms``: how late a 10 ms timer fired on the coordinator's loop.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from rlix_async.bench.coordinator_report import ms as _ms
from rlix_async.bench.coordinator_report import split_calls
from rlix_async.security import ipc_endpoint

GPUS_PER_NODE = 8
PEERS_PER_PROC = 1024
PIPELINES_PER_PROC = 128
_DEAD = re.compile(r"peer (\S+) silent for [\d.]+s: declared dead")


@dataclass(frozen=True)
class CoordinatorBenchConfig:
    peers: int = 4096
    pipelines: int = 256
    duration_s: float = 30.0
    warmup_s: float = 5.0
    step_s: float = 20.0  # one RL step: rollout, then training
    train_fraction: float = 0.2
    shard_delay_ms: float = 200.0  # a simulated shard's sleep, wake or sync
    heartbeat_interval_s: float = 1.0  # CoordinatorConfig's default
    peer_procs: int | None = None  # default: one per 1,024 peers
    driver_procs: int | None = None  # default: one per 128 pipelines
    profile: str | None = None  # write the coordinator's cProfile stats here
    coordinator_log: str | None = None  # keep the coordinator's log (stderr) here
    idle: bool = False  # drivers register and heartbeat only: the cost of liveness alone
    snapshots: str | None = None  # keep every 25th snapshot the planner saw in this directory
    slow_callback_ms: float | None = None  # asyncio debug: log callbacks slower than this
    # the coordinator (and its planner process) on these CPUs, the peers and drivers on
    # the others; None: everything shares every CPU
    coordinator_cpus: list[int] | None = None
    seed: int = 0


def layout(peers: int, pipelines: int) -> dict[str, dict[str, dict[str, Any]]]:
    """Each pipeline's clusters (see the module docstring)."""
    if pipelines < 2 or peers % GPUS_PER_NODE or peers % pipelines:
        raise ValueError(
            f"--peers ({peers}) must be a multiple of {GPUS_PER_NODE} and of --pipelines "
            f"({pipelines}), and --pipelines at least 2"
        )
    block = peers // pipelines
    if block % 2:
        raise ValueError(f"each pipeline's block of {block} devices must be even (TP-2 shards)")
    out = {}
    for i in range(pipelines):
        own = list(range(i * block, (i + 1) * block))
        nxt = list(range(((i + 1) % pipelines) * block, ((i + 1) % pipelines + 1) * block))
        out[f"p{i:04d}"] = {
            "actor_train": {"tp": 1, "devices": own[: max(1, block // 2)]},
            "actor_infer": {"tp": 2, "devices": sorted(own + nxt)},
        }
    return out


def _spec(cfg: CoordinatorBenchConfig, tmp: Path) -> dict[str, Any]:
    pipes = layout(cfg.peers, cfg.pipelines)
    shards = [
        (f"{pid}/infer/{r}", devs[2 * r : 2 * r + 2])
        for pid, clusters in pipes.items()
        for devs in [clusters["actor_infer"]["devices"]]
        for r in range(len(devs) // 2)
    ]
    n_peer = cfg.peer_procs or max(1, math.ceil(cfg.peers / PEERS_PER_PROC))
    n_drv = cfg.driver_procs or max(1, math.ceil(cfg.pipelines / PIPELINES_PER_PROC))
    ids = list(pipes)
    endpoint = ipc_endpoint(f"bench-coordinator-{uuid.uuid4().hex[:8]}")
    coord_cfg = {
        "cluster": {"nodes": cfg.peers // GPUS_PER_NODE, "gpus_per_node": GPUS_PER_NODE},
        "endpoint": endpoint,
        "journal": str(tmp / "journal.jsonl"),  # as `rlix-async launch` runs it
        "heartbeat_interval_s": cfg.heartbeat_interval_s,
    }
    (tmp / "coordinator.json").write_text(json.dumps(coord_cfg))
    return {
        "endpoint": endpoint,
        "coordinator_config": str(tmp / "coordinator.json"),
        "coordinator_stats": str(tmp / "coordinator-stats.json"),
        "pipelines": pipes,
        "peer_groups": [shards[i::n_peer] for i in range(n_peer)],
        "driver_groups": [ids[i::n_drv] for i in range(n_drv)],
        "shard_delay_ms": cfg.shard_delay_ms,
        "heartbeat_interval_s": cfg.heartbeat_interval_s,
        "step_s": cfg.step_s,
        "train_fraction": cfg.train_fraction,
        # awake ranks per pipeline when all roll out: half its rollout devices
        "typical_ranks": max(1, cfg.peers // cfg.pipelines // 2),
        "seed": cfg.seed,
        "idle": cfg.idle,
        "snapshots": str(Path(cfg.snapshots).resolve()) if cfg.snapshots else None,
        "slow_callback_ms": cfg.slow_callback_ms,
        "coordinator_cpus": cfg.coordinator_cpus,
        "load_cpus": (
            sorted(os.sched_getaffinity(0) - set(cfg.coordinator_cpus))
            if cfg.coordinator_cpus
            else None
        ),
    }


class _Child:
    """A child process whose stdout lines are collected by a thread."""

    def __init__(self, name: str, argv: list[str], log: IO[str]) -> None:
        self.name = name
        self.p = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.strip())

    def expect(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"bench coordinator: {self.name} said no {prefix} in {timeout}s")
            try:
                line = self.lines.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.p.poll() is not None:
                    raise RuntimeError(
                        f"bench coordinator: {self.name} exited ({self.p.returncode}) "
                        f"before {prefix}"
                    ) from None
                continue
            if line.startswith(prefix):
                return line

    def tell(self, text: str) -> None:
        assert self.p.stdin is not None
        self.p.stdin.write(text + "\n")
        self.p.stdin.flush()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait(10)


def _cpu_s(procs: list[Any]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def _threads_cpu_s(proc: Any) -> dict[str, float]:
    """CPU seconds per thread name (/proc/PID/task/TID/comm): the event loop is the
    main thread ("loop"); libzmq's I/O thread is ZMQbg/IO/0, worker threads asyncio_N."""
    out: dict[str, float] = {}
    for t in proc.threads():
        if t.id == proc.pid:
            name = "loop"
        else:
            try:
                name = Path(f"/proc/{proc.pid}/task/{t.id}/comm").read_text().strip()
            except OSError:
                name = "gone"
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


async def _measure(
    cfg: CoordinatorBenchConfig,
    endpoint: str,
    coordinator: _Child,
    peers: list[_Child],
    drivers: list[_Child],
) -> dict[str, Any]:
    """Start the drivers' cycles, then sample the window: CPU, RSS, status."""
    import psutil

    from rlix_async.protocols import messages as m
    from rlix_async.transport import RpcClient

    groups = {
        "coord": [psutil.Process(coordinator.p.pid)],
        "peers": [psutil.Process(c.p.pid) for c in peers],
        "drivers": [psutil.Process(c.p.pid) for c in drivers],
        # the coordinator's planner process (SchedulerConfig.planner_process)
        "planner": psutil.Process(coordinator.p.pid).children(),
    }
    status_s: list[float] = []

    failures: list[str] = []

    async def status(rpc: RpcClient) -> m.StatusReply | None:
        t = time.monotonic()
        try:
            reply = await rpc.call(m.StatusRequest(), timeout=30)
        except (ConnectionError, TimeoutError) as exc:  # a starved coordinator: a finding
            failures.append(f"{type(exc).__name__}: {exc}")
            return None
        status_s.append(time.monotonic() - t)
        assert isinstance(reply, m.StatusReply)
        return reply

    # an operator's `rlix-async status`: not a pipeline, not a shard
    async with RpcClient(endpoint, f"bench-{uuid.uuid4().hex[:6]}/cli/0") as rpc:
        t_start = time.monotonic() + cfg.warmup_s
        t_end = t_start + cfg.duration_s
        for c in drivers:
            c.tell(f"GO {t_end}")
        await asyncio.sleep(t_start - time.monotonic())
        cpu0 = {k: _cpu_s(v) for k, v in groups.items()}
        threads0 = _threads_cpu_s(groups["coord"][0])
        w0 = time.monotonic()
        first = await status(rpc)
        rss: list[int] = []
        next_status = w0 + 5.0
        while (left := t_end - time.monotonic()) > 0:
            await asyncio.sleep(min(1.0, left))
            rss.append(groups["coord"][0].memory_info().rss)
            if time.monotonic() >= next_status and t_end - time.monotonic() > 1.0:
                await status(rpc)  # a watcher polling `rlix-async status`
                next_status += 5.0
        cpu1 = {k: _cpu_s(v) for k, v in groups.items()}
        threads1 = _threads_cpu_s(groups["coord"][0])
        wall = time.monotonic() - w0
        last = await status(rpc)
    return {
        "t_start": t_start,
        "t_end": t_end,
        "cpu_pct": {k: round(100 * (cpu1[k] - cpu0[k]) / wall, 1) for k in cpu0},
        "threads_pct": {
            k: round(100 * (v - threads0.get(k, 0.0)) / wall, 1) for k, v in threads1.items()
        },
        "rss_mb": round(rss[-1] / 2**20, 1) if rss else 0.0,
        "rss_max_mb": round(max(rss, default=0) / 2**20, 1),
        "status": _ms(status_s),
        "applied_plans": last.plans - first.plans if first and last else None,
        "rejected_plans": last.rejected_plans if last else None,
        "stale_plans": last.stale_plans - first.stale_plans if first and last else None,
        "fenced_at_end": len(last.fenced) if last else None,
        "status_failures": failures,
        "status_reconnects": rpc.reconnects,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def _profile_top(path: str, n: int = 25) -> list[dict[str, Any]]:
    """The coordinator's heaviest functions by own time (cProfile, whole run)."""
    import pstats

    st: Any = pstats.Stats(path)
    rows = []
    for (file, line, fn), (_cc, ncalls, tottime, cumtime, _callers) in st.stats.items():
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({fn})",
                "ncalls": ncalls,
                "tottime_s": round(tottime, 3),
                "cumtime_s": round(cumtime, 3),
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    return rows[:n]


def _coordinator_argv(cfg: CoordinatorBenchConfig, spec_path: Path) -> list[str]:
    argv = [sys.executable, "-m", "rlix_async.bench.cluster_load", "coordinator", str(spec_path)]
    if cfg.profile:  # the same process under cProfile: stats written when it stops
        argv[1:1] = ["-m", "cProfile", "-o", str(Path(cfg.profile).resolve())]
    return argv


def _start_role(role: str, count: int, spec_path: Path, timeout: float) -> list[_Child]:
    """``count`` processes of ``role``, each READY (its peers welcomed, its pipelines
    registered) within ``timeout``."""
    me = [sys.executable, "-m", "rlix_async.bench.cluster_load"]
    children = [
        _Child(f"{role}-{i}", [*me, role, str(spec_path), str(i)], sys.stderr) for i in range(count)
    ]
    for c in children:
        try:
            c.expect("READY", timeout)
        except RuntimeError:
            for other in children:
                other.stop(signal.SIGKILL)
            raise
    return children


def run_coordinator_bench(cfg: CoordinatorBenchConfig) -> dict[str, Any]:
    from rlix_async.aio import run

    with tempfile.TemporaryDirectory(prefix="rlix-bench-coordinator-") as tmp_name:
        tmp = Path(tmp_name)
        spec = _spec(cfg, tmp)
        spec_path = tmp / "spec.json"
        spec_path.write_text(json.dumps(spec))
        cpus = os.sched_getaffinity(0)
        if spec["load_cpus"]:  # this process polls status and samples CPU: load, too
            os.sched_setaffinity(0, spec["load_cpus"])
        children: list[_Child] = []
        coord_log = Path(cfg.coordinator_log) if cfg.coordinator_log else tmp / "coordinator.log"
        with coord_log.open("w") as log:
            try:
                coord = _Child("coordinator", _coordinator_argv(cfg, spec_path), log)
                children.append(coord)
                try:
                    coord.expect("READY", 60)
                except RuntimeError as exc:
                    raise RuntimeError(f"{exc}\n{coord_log.read_text()[-3000:]}") from None
                t_setup = time.monotonic()
                try:
                    peers = _start_role("peers", len(spec["peer_groups"]), spec_path, 300)
                    children += peers
                    drivers = _start_role("drivers", len(spec["driver_groups"]), spec_path, 300)
                    children += drivers
                except RuntimeError as exc:  # the coordinator could not take the cluster in
                    coord.stop()
                    return _setup_failed(cfg, str(exc), coord_log.read_text(), t_setup)
                setup_s = time.monotonic() - t_setup
                window = run(_measure(cfg, spec["endpoint"], coord, peers, drivers))
                driver_out = [json.loads(c.expect("{", 120)) for c in drivers]
                coord.stop()  # first: commands to stopped peers would be logged as errors
                for c in peers:
                    c.stop()
                peer_out = [json.loads(c.expect("{", 30)) for c in peers]
            finally:
                for c in reversed(children):
                    c.stop(signal.SIGKILL)
                os.sched_setaffinity(0, cpus)
        stats = json.loads(Path(spec["coordinator_stats"]).read_text())
        result = _summarise(cfg, window, driver_out, peer_out, stats, coord_log.read_text())
        result["setup_s"] = round(setup_s, 1)
        result["coordinator_cpus"] = cfg.coordinator_cpus
        if cfg.profile:
            result["profile_top"] = _profile_top(cfg.profile)
        return result


def _setup_failed(
    cfg: CoordinatorBenchConfig, why: str, log: str, t_setup: float
) -> dict[str, Any]:
    """The cluster never came up (peers or drivers not all in within 5 minutes): what
    the coordinator's log says, with the goals missed."""
    dead = count_dead(log)
    return {
        "peers": cfg.peers,
        "pipelines": cfg.pipelines,
        "setup_failed": why.splitlines()[0],
        "setup_s": round(time.monotonic() - t_setup, 1),
        "calls": 0,
        "false_dead": len(dead),
        "declared_dead": sorted(dead)[:10],
        "coordinator_errors": sum(" ERROR " in line for line in log.splitlines()),
        "goals": {"false_dead == 0": False, "p99_ms <= 50": False},
    }


def _in(rows: list[list[float]], t0: float, t1: float, col: int = 1) -> list[float]:
    """Column ``col`` (1: wall seconds, 2: CPU seconds) of the samples that started in
    the window (each row starts with its start time)."""
    return [row[col] for row in rows if t0 <= row[0] < t1]


def _summarise(
    cfg: CoordinatorBenchConfig,
    window: dict[str, Any],
    drivers: list[dict[str, Any]],
    peers: list[dict[str, Any]],
    stats: dict[str, Any],
    log: str,
) -> dict[str, Any]:
    t0, t1 = window["t_start"], window["t_end"]
    dead = count_dead(log)
    commands: Counter[str] = Counter()
    for p in peers:
        commands.update(p["commands"])
    errors = [line for line in log.splitlines() if " ERROR " in line]
    result = {
        **_client_side(cfg, drivers, peers, stats, t0, t1),
        "false_dead": len(dead),
        "declared_dead": sorted(dead)[:10],
        "peer_hb_gap_max_s": max((p["hb_gap_max_s"] for p in peers), default=0.0),
        "server_gap_max_s": max((p["server_gap_max_s"] for p in peers), default=0.0),
        "peer_saw_coordinator_silent": sum(p["server_silent"] for p in peers),
        "peer_not_registered": sum(p["not_registered"] for p in peers),
        "driver_reconnects": sum(d["reconnects"] for d in drivers),
        "driver_failures": [f for d in drivers for f in d["failed"]][:5],
        "coord_cpu_pct": window["cpu_pct"]["coord"],
        "coord_loop_cpu_pct": window["threads_pct"].get("loop", 0.0),  # the event loop alone
        "coord_threads_cpu_pct": window["threads_pct"],
        "peers_cpu_pct": window["cpu_pct"]["peers"],
        "drivers_cpu_pct": window["cpu_pct"]["drivers"],
        "planner_process_cpu_pct": window["cpu_pct"]["planner"],
        "coord_rss_mb": window["rss_mb"],
        "coord_rss_max_mb": window["rss_max_mb"],
        **_coordinator_side(cfg, window, drivers, stats, t0, t1),
        "status_ms": window["status"],
        "status_failures": window["status_failures"][:3],
        "status_reconnects": window["status_reconnects"],
        "shard_commands": dict(commands),
        "fenced_at_end": window["fenced_at_end"],
        "coordinator_errors": len(errors),
        "coordinator_error_lines": errors[:5],
        "loadavg": window["loadavg"],
    }
    result["goals"] = {
        "false_dead == 0": result["false_dead"] == 0,
        "p99_ms <= 50": result["p99_ms"] <= 50,
    }
    return result


def _client_side(
    cfg: CoordinatorBenchConfig,
    drivers: list[dict[str, Any]],
    peers: list[dict[str, Any]],
    stats: dict[str, Any],
    t0: float,
    t1: float,
) -> dict[str, Any]:
    """The run's shape and what the drivers saw: call latencies, grants, steps."""
    calls = [c for d in drivers for c in d["calls"] if t0 <= c[1] < t1]
    by_call: dict[str, list[float]] = {}
    for name, _, dt, *_ in calls:
        by_call.setdefault(name, []).append(dt)
    latency = _ms([c[2] for c in calls])
    return {
        "peers": cfg.peers,
        "pipelines": cfg.pipelines,
        "devices": cfg.peers,
        "duration_s": cfg.duration_s,
        "warmup_s": cfg.warmup_s,
        "step_s": cfg.step_s,
        "shard_delay_ms": cfg.shard_delay_ms,
        "calls": latency["n"],
        "p50_ms": latency["p50_ms"],
        "p99_ms": latency["p99_ms"],
        "max_ms": latency["max_ms"],
        "by_call": {name: _ms(v) for name, v in sorted(by_call.items())},
        "call_split": split_calls(calls, stats.get("handled", {})),
        "grant_wait": _ms([w for d in drivers for w in _in(d["grants"], t0, t1)]),
        "steps": sum(t0 <= t < t1 for d in drivers for t in d["steps"]),
        "progress_per_s": round(
            sum(d["progress_sent"] for d in drivers) / (cfg.warmup_s + cfg.duration_s), 1
        ),
    }


def _coordinator_side(
    cfg: CoordinatorBenchConfig,
    window: dict[str, Any],
    drivers: list[dict[str, Any]],
    stats: dict[str, Any],
    t0: float,
    t1: float,
) -> dict[str, Any]:
    """What the coordinator's own timers saw: planning, journal, loop turns, GC."""
    schedule = _in(stats.get("schedule", []), t0, t1)
    schedule_cpu = _in(stats.get("schedule", []), t0, t1, col=2)
    return {
        # planner runs (however the coordinator schedules them)
        "plans_per_s": round(len(_in(stats.get("plan", []), t0, t1)) / cfg.duration_s, 1),
        "applied_plans_per_s": (
            None
            if window["applied_plans"] is None
            else round(window["applied_plans"] / cfg.duration_s, 1)
        ),
        "rejected_plans": window["rejected_plans"],
        "stale_plans": window["stale_plans"],
        "schedule_ms": _ms(schedule),
        "schedule_busy_pct": round(100 * sum(schedule) / cfg.duration_s, 1),
        "schedule_cpu_ms": _ms(schedule_cpu),
        "schedule_cpu_pct": round(100 * sum(schedule_cpu) / cfg.duration_s, 1),
        "plan_ms": _ms(_in(stats.get("plan", []), t0, t1)),
        "plan_cpu_ms": _ms(_in(stats.get("plan", []), t0, t1, col=2)),
        "plan_cpu_pct": round(100 * sum(_in(stats.get("plan", []), t0, t1, 2)) / cfg.duration_s, 1),
        "snapshot_ms": _ms(_in(stats.get("snapshot", []), t0, t1)),
        "check_ms": _ms(_in(stats.get("check", []), t0, t1)),
        "journal_ms": _ms(_in(stats.get("journal", []), t0, t1)),
        "journal_sync_ms": _ms(_in(stats.get("journal_sync", []), t0, t1)),
        "loop_lag_ms": _ms(_in(stats.get("lag", []), t0, t1)),
        # the reader's turns: messages read per second, and how long a turn held the loop
        "received_per_s": round(sum(_in(stats.get("drains", []), t0, t1, 2)) / cfg.duration_s),
        "reader_turn_ms": _ms(_in(stats.get("drains", []), t0, t1)),
        # the drivers' own loops: a reply read late there is not the coordinator's
        "driver_loop_lag_ms": _ms([x for d in drivers for x in _in(d.get("lag", []), t0, t1)]),
        "worst_stalls": _worst_stalls(stats, t0, t1),
        # the cyclic GC's pauses, and those of full (generation 2) collections
        "gc_ms": _ms(_in(stats.get("gc", []), t0, t1)),
        "gc_full_ms": _ms(
            [row[1] for row in stats.get("gc", []) if t0 <= row[0] < t1 and row[2] == 2]
        ),
    }


def _worst_stalls(stats: dict[str, Any], t0: float, t1: float) -> list[dict[str, Any]]:
    """The longest stalls of the loop, each with how long after a scheduling step's
    start it ended (a stall right after one is the plan or its realisation)."""
    starts = sorted(row[0] for row in stats.get("snapshot", []))
    worst = sorted((row for row in stats.get("lag", []) if t0 <= row[0] < t1), key=lambda r: -r[1])
    stalls = []
    for end, lag_s, cpu_s in worst[:8]:
        before = [s for s in starts if s <= end]
        stalls.append(
            {
                "at_s": round(end - t0, 2),
                "ms": round(1000 * lag_s, 1),
                # the loop thread's CPU meanwhile: far below "ms", it waited (a core,
                # a system call), not ran
                "loop_cpu_ms": round(1000 * cpu_s, 1),
                "after_plan_start_ms": round(1000 * (end - before[-1]), 1) if before else None,
            }
        )
    return stalls


def count_dead(log: str) -> Counter[str]:
    """Identities the coordinator declared dead, from its log."""
    return Counter(m.group(1) for m in _DEAD.finditer(log))
