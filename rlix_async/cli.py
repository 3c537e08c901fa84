"""The ``rlix-async`` command: one subcommand per user-facing tool."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlix_async.sim.scenario import Scenario


def _cmd_keygen(args: argparse.Namespace) -> int:
    from rlix_async.security import keygen

    written = keygen(args.dir, args.client or None)
    for path in written:
        print(path)
    if not written:
        print(f"{args.dir}: keys already present, nothing written")
    print(f"copy {args.dir} to every node (0600 files); pass --keys {args.dir} to each process")
    return 0


def _cmd_bench_rpc(args: argparse.Namespace) -> int:
    from rlix_async.bench.rpc import RpcBenchConfig, format_rpc_result, run_rpc_bench

    cfg = RpcBenchConfig(
        transport=args.transport,
        calls=args.calls,
        window=args.window,
        vs_ray=args.vs_ray,
        pin=args.pin,
    )
    result = run_rpc_bench(cfg)
    print(json.dumps(result, indent=2) if args.json else format_rpc_result(result))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from rlix_async.control.planner import SnapshotError, check_plan, decode_snapshot, plan

    try:
        snap = decode_snapshot(Path(args.snapshot).read_bytes())
    except OSError as exc:
        print(f"error: cannot read {args.snapshot}: {exc}", file=sys.stderr)
        return 2
    except SnapshotError as exc:
        print(f"error: invalid snapshot {args.snapshot}: {exc}", file=sys.stderr)
        return 2
    result = plan(snap)
    violations = check_plan(snap, result)
    if violations:  # a planner bug: say so loudly, never print the plan as if sound
        print("error: the plan breaks invariants:\n  " + "\n  ".join(violations), file=sys.stderr)
        return 1
    if args.json:
        import msgspec

        print(msgspec.json.encode(result).decode())
        return 0
    for g in result.grants:
        print(f"grant   {g.pipeline}/{g.cluster} {g.priority} devices {g.devices}")
    for ch in result.shrink:
        print(f"shrink  {ch.pipeline}/{ch.cluster} ranks {ch.ranks}")
    for ch in result.expand:
        print(f"expand  {ch.pipeline}/{ch.cluster} ranks {ch.ranks}")
    for w in result.waiting:
        print(f"waiting {w.pipeline}/{w.cluster}: {w.reason}")
    print(f"idle    {result.idle_devices}")
    return 0


def _cmd_bench_plan(args: argparse.Namespace) -> int:
    from rlix_async.bench.plan import run_plan_bench

    result = run_plan_bench(args.gpus, args.pipelines, args.snapshots, args.seed)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"plan on {args.gpus} devices / {args.pipelines} pipelines "
            f"({result['snapshots']} random snapshots): p50 {result['plan_ms_p50']:.2f} ms, "
            f"p99 {result['plan_ms_p99']:.2f} ms; check_plan p50 {result['check_ms_p50']:.2f} ms"
        )
    return 0


def _transport_config(args: argparse.Namespace) -> object:
    from rlix_async.transport import TransportConfig

    hb = args.heartbeat_interval
    return TransportConfig(heartbeat_interval_s=hb, heartbeat_timeout_s=2.5 * hb)


async def _until_signal() -> None:
    """Serve until SIGINT or SIGTERM."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def _cmd_coordinator(args: argparse.Namespace) -> int:
    from rlix_async.aio import run
    from rlix_async.control.coordinator import Coordinator, CoordinatorConfig
    from rlix_async.control.topology import ClusterShape
    from rlix_async.security import ServerKeys, ipc_endpoint

    async def main() -> None:
        endpoint = args.endpoint or ipc_endpoint("coordinator")
        keys = ServerKeys.load(args.keys) if args.keys else None
        coord = Coordinator(
            endpoint,
            ClusterShape(nodes=args.nodes, gpus_per_node=args.gpus_per_node),
            journal=args.journal,
            keys=keys,
            transport=_transport_config(args),  # type: ignore[arg-type]
            config=CoordinatorConfig(
                lease_timeout_s=args.lease_timeout, rebalance_s=args.rebalance
            ),
            metrics_port=args.metrics_port,
        )
        await coord.start()
        print(f"READY {coord.endpoint}", flush=True)
        await _until_signal()
        await coord.close()

    run(main())
    return 0


def _cmd_status(args: argparse.Namespace) -> int:
    from rlix_async.aio import run
    from rlix_async.control.status import show_status

    return run(show_status(args.endpoint, args.keys, watch=args.watch, interval=args.interval))


def _cmd_shard(args: argparse.Namespace) -> int:
    import asyncio

    from rlix_async.aio import run
    from rlix_async.security import ClientKeys, ServerKeys, ipc_endpoint
    from rlix_async.shards.worker import ShardWorker

    async def main() -> None:
        if args.engine == "vllm":
            from rlix_async.shards.vllm_engine import VllmEngine, VllmEngineConfig

            if not args.model:
                raise SystemExit("--model is required with --engine vllm")
            engine = VllmEngine(
                VllmEngineConfig(
                    model=args.model,
                    dtype=args.dtype,
                    max_model_len=args.max_model_len,
                    kv_cache_memory_bytes=args.kv_cache_mb << 20 if args.kv_cache_mb else None,
                    enable_sleep_mode=args.sleep_mode,
                )
            )
        else:  # test double for control-plane runs with many shards (see scripted.py)
            from rlix_async.shards.scripted import ScriptedEngine

            engine = ScriptedEngine(token_delay_s=args.token_delay)
        keys = ClientKeys.load(args.keys) if args.keys else None
        worker = ShardWorker(
            engine,
            args.coordinator or ipc_endpoint("coordinator"),
            args.pipeline,
            args.rank,
            keys=keys,
            transport=_transport_config(args),  # type: ignore[arg-type]
            data_endpoint=args.data_endpoint,
            # a tcp data plane (routers on other nodes) is authenticated like every tcp socket
            data_keys=ServerKeys.load(args.keys)
            if args.keys and (args.data_endpoint or "").startswith("tcp://")
            else None,
        )
        await worker.start()
        print(f"READY {worker.data.endpoint}", flush=True)
        dead = asyncio.ensure_future(worker.engine_dead.wait())
        signalled = asyncio.ensure_future(_until_signal())
        await asyncio.wait([dead, signalled], return_when=asyncio.FIRST_COMPLETED)
        signalled.cancel()
        t0 = time.monotonic()
        await worker.close()
        if dead.done():  # exit non-zero so a launcher replaces this worker
            raise SystemExit(3)
        dead.cancel()
        t1 = time.monotonic()
        if hasattr(engine, "shutdown"):
            engine.shutdown()
        print(
            f"stopped: worker closed in {t1 - t0:.1f} s, engine in {time.monotonic() - t1:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    run(main())
    return 0


def _cmd_kill(args: argparse.Namespace) -> int:
    import uuid

    from rlix_async.aio import run
    from rlix_async.control.messages import Unregister
    from rlix_async.security import ClientKeys, ipc_endpoint
    from rlix_async.transport import RpcClient

    async def main() -> None:
        endpoint = args.endpoint or ipc_endpoint("coordinator")
        keys = ClientKeys.load(args.keys) if args.keys else None
        async with RpcClient(endpoint, f"admin-{uuid.uuid4().hex[:6]}/cli/0", keys=keys) as c:
            await c.call(Unregister(pipeline_id=args.pipeline), timeout=10)

    run(main())
    print(f"{args.pipeline}: leases released, pipeline removed")
    return 0


def _cmd_timeline(args: argparse.Namespace) -> int:
    from rlix_async.control.timeline import draw_timeline

    out = draw_timeline(args.journal, args.output)
    print(out)
    return 0


def _cmd_bench_weights(args: argparse.Namespace) -> int:
    from rlix_async.bench.weights import run_weights_bench

    r = run_weights_bench(args.size_mb, args.bucket_mb, args.credits)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"{r['size_mb']} MiB in {r['buckets']} buckets of {r['bucket_mb']} MiB "
        f"({r['credits']} in flight)"
    )
    for key in ("memcpy_gibps", "local_gibps", "remote_gibps", "zmq_raw_gibps"):
        print(f"  {key:14s} {r[key]:6.2f} GiB/s")
    print(
        f"  peak_extra_mb  {r['peak_extra_mb']:6.1f} MiB (local {r['local_extra_mb']:.1f}, "
        f"remote {r['remote_extra_mb']:.1f})"
    )
    return 0


def _cmd_bench_preempt(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays JSON
    from rlix_async.aio import run
    from rlix_async.bench.preempt import format_preempt_result, run_preempt_bench

    r = run(
        run_preempt_bench(
            requests=args.requests,
            max_tokens=args.max_tokens,
            rounds=args.rounds,
            kv_cache_mb=args.kv_cache_mb,
        )
    )
    print(json.dumps(r, indent=2) if args.json else format_preempt_result(r))
    return 0 if r["lost_requests"] == 0 else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from rlix_async.demo import format_summary, run_demo

    try:
        summary = run_demo(args.out, steps=args.steps)
    except KeyboardInterrupt:
        print("stopped (every process and shared-memory segment cleaned up)", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    print(f"wrote {args.out}/summary.json, journal.jsonl, timeline.png, reward.png")
    return 0 if summary["lost_trajectories"] == 0 else 1


def _cmd_launch(args: argparse.Namespace) -> int:
    from rlix_async.launch import Launcher, load_launch_config

    cfg = load_launch_config(args.config)
    launcher = Launcher(cfg, resume=args.resume)
    try:
        launcher.run()
    except KeyboardInterrupt:
        print("stopped (every process and shared-memory segment cleaned up)", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"all pipelines finished; logs and metrics under {cfg.out}")
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from rlix_async.sim.engine import simulate
    from rlix_async.sim.scenario import ScenarioError, load_scenario

    try:
        sc = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.seeds is not None:
        return _simulate_seeds(sc, args)
    policies = ["exclusive", "timeshare"] if args.policy == "all" else [args.policy]
    out = {
        pol: simulate(sc, pol, seed=args.seed, journal=args.journal if pol == "timeshare" else None)
        for pol in policies
    }
    if args.json:
        print(json.dumps({"policies": out}, indent=2))
        return 0
    for pol, r in out.items():
        print(
            f"{pol:10s} {r['steps_per_hour_per_gpu']:.3f} steps/h/GPU on {r['devices']} devices, "
            f"makespan {r['makespan_s']:.0f} s, utilization {r['gpu_utilization']:.2f}, "
            f"preemptions {r['preemptions']}, switching {r['wasted_gpu_s']:.0f} GPU-s"
        )
    if len(out) == 2 and out["exclusive"]["steps_per_hour_per_gpu"]:
        gain = (
            out["timeshare"]["steps_per_hour_per_gpu"] / out["exclusive"]["steps_per_hour_per_gpu"]
        )
        print(f"timeshare / exclusive: {gain:.2f}x")
    return 0


def _simulate_seeds(sc: Scenario, args: argparse.Namespace) -> int:
    from rlix_async.sim.engine import seed_sweep

    if args.seeds < 1 or args.policy != "all" or args.journal:
        print("error: --seeds N compares both policies and writes no journal", file=sys.stderr)
        return 2
    out = seed_sweep(sc, range(args.seed, args.seed + args.seeds))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    for r in out["runs"]:
        worst = max(r["slowdown"].values(), default=0.0)
        print(
            f"seed {r['seed']:3d}: timeshare / exclusive {r['gain']:.2f}x, "
            f"slowest pipeline's step {worst:.2f}x its exclusive one"
        )
    g, s = out["gain"], out["slowdown"]
    print(
        f"gain min {g['min']:.2f}x, mean {g['mean']:.2f}x, max {g['max']:.2f}x; "
        f"step slowdown mean {s['mean']:.2f}x, max {s['max']:.2f}x"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlix-async",
        description="Time-share GPUs between LLM RL pipelines (asyncio + ZMQ control plane).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("keygen", help="create CURVE keys for tcp:// endpoints")
    p.add_argument("dir", type=Path, help="key directory (created 0700)")
    p.add_argument(
        "--client",
        action="append",
        metavar="NAME",
        help="client key pair name (repeatable; default: client)",
    )
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser("coordinator", help="run the coordinator (one per cluster)")
    p.add_argument("--endpoint", help="ipc:// or tcp:// (default: ipc in the private dir)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--journal", help="append scheduling events here (JSONL); replayed on restart")
    p.add_argument("--keys", help="CURVE key directory (required for tcp://)")
    p.add_argument(
        "--lease-timeout",
        type=float,
        default=10.0,
        help="seconds a silent driver keeps its devices",
    )
    p.add_argument("--rebalance", type=float, default=2.0, help="slow rebalancing timer (s)")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.set_defaults(func=_cmd_coordinator)

    p = sub.add_parser("shard", help="run one shard worker (inference engine) process")
    p.add_argument("--pipeline", required=True)
    p.add_argument("--rank", type=int, required=True, help="DP rank in actor_infer")
    p.add_argument("--coordinator", help="coordinator endpoint (default: local ipc)")
    p.add_argument("--keys", help="CURVE key directory for tcp://")
    p.add_argument("--data-endpoint", help="where the router reaches it (default: local ipc)")
    p.add_argument(
        "--engine",
        choices=["vllm", "scripted"],
        default="vllm",
        help="scripted: a test double with no model, for control-plane runs",
    )
    p.add_argument("--model", help="HF model directory (vllm)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-mb", type=int, help="KV cache size (required on CPU)")
    p.add_argument("--sleep-mode", action="store_true", help="GPU: enable vLLM sleep mode")
    p.add_argument("--token-delay", type=float, default=0.01, help="scripted: s per token")
    p.add_argument("--heartbeat-interval", type=float, default=1.0)
    p.set_defaults(func=_cmd_shard)

    p = sub.add_parser("status", help="devices x pipelines, live from the coordinator")
    p.add_argument("--endpoint", help="coordinator endpoint (default: local ipc)")
    p.add_argument("--keys", help="CURVE key directory for tcp://")
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0)
    p.set_defaults(func=_cmd_status)

    p = sub.add_parser("kill", help="drop a pipeline and release everything it holds")
    p.add_argument("pipeline")
    p.add_argument("--endpoint", help="coordinator endpoint (default: local ipc)")
    p.add_argument("--keys", help="CURVE key directory for tcp://")
    p.set_defaults(func=_cmd_kill)

    p = sub.add_parser("timeline", help="per-device Gantt chart of a journal")
    p.add_argument("journal")
    p.add_argument("-o", "--output", default="timeline.png")
    p.set_defaults(func=_cmd_timeline)

    p = sub.add_parser("plan", help="run the planner once on a snapshot (what-if tool)")
    p.add_argument("snapshot", help="snapshot JSON (format in docs/SCHEDULING.md)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("demo", help="two GRPO pipelines time-sharing 4 CPU devices (main job)")
    p.add_argument("--out", default="rlix-demo", help="output directory")
    p.add_argument("--steps", type=int, default=15, help="training steps per pipeline")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("launch", help="coordinator, shards and torchrun pipelines from a YAML")
    p.add_argument("config", help="PIPELINES.yaml (format in rlix_async/launch.py)")
    p.add_argument("--resume", action="store_true", help="pipelines continue from checkpoints")
    p.set_defaults(func=_cmd_launch)

    p = sub.add_parser("simulate", help="discrete-event simulation of a scenario (real planner)")
    p.add_argument("scenario", help="SCENARIO.yaml (see scenarios/)")
    p.add_argument("--policy", choices=["exclusive", "timeshare", "all"], default="all")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--journal", help="write the timeshare run's journal (rlix-async timeline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--seeds", type=int, metavar="N", help="both policies on seeds SEED..SEED+N-1: the spread"
    )
    p.set_defaults(func=_cmd_simulate)

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = bsub.add_parser("rpc", help="RPC round trip p50/p99 and throughput between processes")
    p.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    p.add_argument("--calls", type=int, default=5000, help="sequential calls timed")
    p.add_argument("--window", type=int, default=64, help="calls in flight for throughput")
    p.add_argument("--vs-ray", action="store_true", help="same pattern against a Ray actor")
    p.add_argument(
        "--pin",
        choices=["none", "shared", "split"],
        default="none",
        help="CPU placement: kernel's choice, client and server on one CPU, or one CPU each",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_bench_rpc)
    p = bsub.add_parser("plan", help="planner latency on random realistic snapshots")
    p.add_argument("--gpus", type=int, default=4096)
    p.add_argument("--pipelines", type=int, default=256)
    p.add_argument("--snapshots", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_bench_plan)
    p = bsub.add_parser("weights", help="weight sync: shared memory, tcp, raw ZMQ, memcpy")
    p.add_argument("--size-mb", type=int, default=1024)
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--credits", type=int, default=2, help="buckets in flight (remote)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_bench_weights)
    p = bsub.add_parser("preempt", help="shrink a vLLM shard under load: latency, waste, losses")
    p.add_argument("--requests", type=int, default=32, help="requests in flight")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=3, help="shrink/expand rounds")
    p.add_argument("--kv-cache-mb", type=int, default=64, help="KV cache per engine (CPU)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_bench_preempt)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
