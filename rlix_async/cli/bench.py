"""``rlix-async bench ...``: benchmarks that print figures (record them in docs/PERF.md)."""

from __future__ import annotations

import argparse
import json
import os

from rlix_async.cli.args import UsageError, positive_int
from rlix_async.cli.bench_delta import register_delta
from rlix_async.cli.bench_transparency import register_transparency


def _rpc(args: argparse.Namespace) -> int:
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


def _fuzz(args: argparse.Namespace) -> int:
    from rlix_async.bench.fuzz import run_fuzz_bench

    model = None
    if args.target == "env":
        from rlix_async.models.pretrained import convert

        model = args.model or str(convert("smollm2-135m-instruct"))
    r = run_fuzz_bench(args.target, args.inputs, args.seed, model)
    if args.json:
        print(json.dumps(r, indent=2))
    elif r["target"] == "env":
        print(
            f"env: {r['inputs']} broken episodes in {r['hostile_s']} s "
            f"({', '.join(f'{k} {v}' for k, v in r['kinds'].items())}); "
            f"{r['workers_replaced']} env workers replaced; the driver's loop lagged at most "
            f"{r['loop_lag_max_s']} s (its own CPU at most {r['loop_cpu_max_s']} s a tick); "
            f"then {r['then_served']} good episodes finished"
            + "".join(f"\n  problem: {p}" for p in r["problems"])
        )
    elif r["target"] == "store":
        print(
            f"store: {r['inputs']} hostile connections in {r['hostile_s']} s "
            f"({', '.join(f'{k} {v}' for k, v in r['kinds'].items())}); refused {r['refused']}, "
            f"bytes sent to them beyond the nonce {r['bytes_to_hostile']}, keys they wrote "
            f"{len(r['foreign_keys'])}; meanwhile two ranks handed over "
            f"{r['batches_handed_over']} batches "
            f"{'intact' if r['then_served_intact'] else 'NOT INTACT'}"
        )
    else:
        print(
            f"{r['target']}: {r['inputs']} hostile connections in {r['hostile_s']} s "
            f"({', '.join(f'{k} {v}' for k, v in r['kinds'].items())}); refused {r['refused']}, "
            f"bytes sent to them {r['bytes_to_hostile']}; then a granted stream "
            f"{'landed every byte' if r['then_served_intact'] else 'DID NOT land intact'}"
        )
    return 0 if r["ok"] else 1


def _plan(args: argparse.Namespace) -> int:
    from rlix_async.bench.plan import run_plan_bench

    result = run_plan_bench(args.gpus, args.pipelines, args.snapshots, args.seed, args.fairness)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"plan ({args.fairness}) on {args.gpus} devices / {args.pipelines} pipelines "
        f"({result['snapshots']} random snapshots): p50 {result['plan_ms_p50']:.2f} ms, "
        f"p99 {result['plan_ms_p99']:.2f} ms; check_plan p50 {result['check_ms_p50']:.2f} ms"
    )
    return 0


def _weights(args: argparse.Namespace) -> int:
    only = {"credits": "tensors", "rounds": "vllm", "streams": "tensors"}  # one receiver's
    if args.streams is not None and not 1 <= args.streams <= 16:
        raise UsageError(f"--streams: 1..16 (weights.streams' bounds), not {args.streams}")
    for option, receiver in only.items():
        if getattr(args, option) is not None and args.receiver != receiver:
            raise UsageError(f"--{option} applies to --receiver {receiver} only")
    cluster = ("shards_per_host", "tp", "link_mbit", "path", "transport", "versions", "wake_after",
               "fault", "delta")  # fmt: skip
    for flag in ("no_relay", "no_prefetch"):
        if getattr(args, flag) and args.hosts is None:
            raise UsageError(f"--{flag.replace('_', '-')}: only with --hosts N")
    if args.hosts is not None:
        return _weights_cluster(args)
    given = [f"--{o.replace('_', '-')}" for o in cluster if getattr(args, o) is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: only with --hosts N")
    if args.receiver == "vllm":
        return _weights_vllm(args)
    from rlix_async.bench.weights import run_weights_bench

    r = run_weights_bench(
        args.size_mb or 1024, args.bucket_mb, args.credits or 2, args.streams or 2
    )
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"{r['size_mb']} MiB in {r['buckets']} buckets of {r['bucket_mb']} MiB "
        f"({r['credits']} in flight), {r['streams']} streams"
    )
    for key in ("memcpy_gibps", "local_gibps", "curve_sync_gibps", "curve_gibps"):
        print(f"  {key:16s} {r[key]:6.2f} GiB/s")
    for key in sorted(k for k in r if k.startswith(("sealed_x", "plain_x"))):
        print(f"  {key:16s} {r[key]:6.2f} GiB/s")
    print(f"  {'plain_tcp_gibps':16s} {r['plain_tcp_gibps']:6.2f} GiB/s")
    print(
        f"  remote (sealed x {r['streams']}) = {r['remote_vs_curve']:.2f} x curve, "
        f"{r['remote_vs_plain_x1']:.2f} x plain x 1, {r['remote_vs_plain_tcp']:.2f} x plain_tcp"
    )
    print(
        f"  peak_extra_mb  {r['peak_extra_mb']:6.1f} MiB (local {r['local_extra_mb']:.1f}, "
        f"remote {r['remote_extra_mb']:.1f})"
    )
    return 0


def _weights_cluster(args: argparse.Namespace) -> int:
    if os.geteuid() != 0:
        raise UsageError("--hosts makes network namespaces and shapes links: run it as root")
    if args.receiver != "tensors":
        raise UsageError("--hosts: the workers load as the rlix_shm backend does; no --receiver")
    if args.fault and args.path == "worker":
        raise UsageError("--fault: node caches only (not --path worker)")
    if args.delta and args.path == "worker":
        raise UsageError("--delta: node caches only (a worker holds no version to build on)")
    if args.fault == "kill-relay" and (args.hosts < 2 or args.no_relay or args.no_prefetch):
        raise UsageError(
            "--fault kill-relay: needs a relay (--hosts 2 or more, relayed) and prefetch "
            "(the killed receiver's successor takes the version on its own)"
        )
    import signal

    from rlix_async.bench.hosts import HostsError
    from rlix_async.bench.weights_cluster import run_cluster_bench

    def _stopped(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through the hosts' removal

    signal.signal(signal.SIGTERM, _stopped)
    try:
        r = run_cluster_bench(
            args.hosts,
            args.shards_per_host or 1,
            args.tp or 1,
            args.link_mbit or 1000,
            model_mb=args.size_mb or 256,
            bucket_mb=args.bucket_mb,
            transport=args.transport or "sealed",
            path=args.path or "node",
            versions=args.versions or 3,
            relay=not args.no_relay,
            streams=args.streams or 2,
            wake_after_s=args.wake_after or 0.0,
            prefetch=not args.no_prefetch,
            fault=args.fault or "",
            delta=args.delta or 0.0,
        )
    except HostsError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"{r['hosts']} hosts x {r['shards_per_host']} shards x tp {r['tp']}, links "
        f"{r['link_mbit']} Mbit/s, {r['model_mb']} MiB, {r['transport']} x {r['streams']}, "
        f"path {r['path']}" + (", relayed" if r["relay"] else "")
        + (f", asleep {r['wake_after_s']} s" if r["wake_after_s"] else "")
        + (", prefetch" if r["prefetch"] else "")
    )  # fmt: skip
    for key in (
        "owner_egress_per_model",
        "seconds_one_link",
        "seconds_to_all",
        "seconds_to_all_over_one_link",
        "seconds_wake_to_all",
        "seconds_nodes_hold_over_bound",
        "node_extra_mem_per_model",
        "link_utilization",
        "cores_busy",
    ):
        if key in r:
            print(f"  {key:30s} {r[key]}")
    return 0


def _engine(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays JSON
    from rlix_async.bench.engine_curve import format_engine_result, run_engine_bench

    try:
        batches = tuple(int(b) for b in args.batches.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise UsageError("--batches: comma-separated sizes >= 1")
    model = args.model
    if model is None:
        from rlix_async.models.pretrained import convert

        model = str(convert("smollm2-135m-instruct"))
    r = run_engine_bench(model, batches, tokens=args.tokens, repeats=args.repeats)
    print(json.dumps(r, indent=2) if args.json else format_engine_result(r))
    return 0


def _weights_vllm(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays JSON
    from rlix_async.bench.weights import run_vllm_weights_bench

    r = run_vllm_weights_bench(args.size_mb or 256, args.bucket_mb, args.rounds or 5)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(
        f"vLLM engine ({r['device']}), random Llama of {r['size_mb']} MiB "
        f"({r['tensors']} tensors), {r['bucket_mb']} MiB buckets, best of {r['rounds']} syncs"
    )
    for key in ("vllm_gibps", "vllm_inmemory_gibps", "plain_tensors_gibps", "memcpy_gibps"):
        print(f"  {key:20s} {r[key]:6.2f} GiB/s")
    print(
        f"  vllm_vs_inmemory     {r['vllm_vs_inmemory']:6.2f}  (median sync against vLLM's "
        f"own reload from memory; path: {r['load_path']}"
        + (f", {r['reload_reason']})" if r["reload_reason"] else ")")
    )
    print(
        f"  engine_extra_mb      {r['engine_extra_mb']:6.1f} MiB "
        f"({r['engine_extra_per_model']:.2f} x the model): the engine's processes' peak "
        f"private memory during syncs over before the first; {r['engine_retained_mb']:.1f} "
        "MiB held at most after a sync"
    )
    return 0


def _gpu(args: argparse.Namespace) -> int:
    from rlix_async.bench.gpu import cuda_available, format_gpu_result, run_gpu_bench

    if not cuda_available():
        raise UsageError("bench gpu needs a CUDA device")
    r = run_gpu_bench(args.gib, args.model_mb, args.repeats)
    print(json.dumps(r, indent=2) if args.json else format_gpu_result(r))
    return 0 if all(r["targets_met"].values()) else 1


def _fraction(text: str) -> float:
    x = _positive_float(text)
    if x >= 1:
        raise argparse.ArgumentTypeError(f"a fraction below 1, got {text}")
    return x


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return x


def _cpu_list(text: str) -> list[int]:
    """'1', '0,2' or '2-3' as a sorted list of CPU numbers this process may use, with
    at least one left over for the load generator."""
    from rlix_async.placement import parse_cpu_list

    try:
        cpus = set(parse_cpu_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPUs like '1' or '2-3', got {text!r}") from None
    usable = os.sched_getaffinity(0)
    if not cpus or not cpus <= usable or not usable - cpus:
        raise argparse.ArgumentTypeError(
            f"{text!r}: must be some, not all, of the CPUs this process may use "
            f"({','.join(map(str, sorted(usable)))})"
        )
    return sorted(cpus)


def _preempt(args: argparse.Namespace) -> int:
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


def _episodes(args: argparse.Namespace) -> int:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout stays JSON
    from rlix_async.aio import run
    from rlix_async.bench.episodes import format_episodes_result, run_episodes_bench
    from rlix_async.models.pretrained import convert

    model = args.model or str(convert("smollm2-135m-instruct"))
    r = run(
        run_episodes_bench(
            model,
            episodes=args.episodes,
            turns=args.turns,
            max_tokens=args.max_tokens,
            kv_cache_mb=args.kv_cache_mb,
        )
    )
    print(json.dumps(r, indent=2) if args.json else format_episodes_result(r))
    return 0 if r["failed"] == 0 and r["heartbeat_gap_s_max"] < r["heartbeat_timeout_s"] else 1


def _coordinator(args: argparse.Namespace) -> int:
    from rlix_async.bench.coordinator import CoordinatorBenchConfig, run_coordinator_bench
    from rlix_async.bench.coordinator_report import format_result

    cfg = CoordinatorBenchConfig(
        peers=args.peers,
        pipelines=args.pipelines,
        duration_s=args.duration,
        warmup_s=args.warmup,
        step_s=args.step_s,
        shard_delay_ms=args.shard_delay_ms,
        peer_procs=args.peer_procs,
        driver_procs=args.driver_procs,
        profile=args.profile,
        coordinator_log=args.coordinator_log,
        idle=args.idle,
        snapshots=args.snapshots,
        slow_callback_ms=args.slow_callback_ms,
        coordinator_cpus=args.coordinator_cpus,
    )
    try:
        r = run_coordinator_bench(cfg)
    except ValueError as exc:  # a layout the peers and pipelines cannot make
        raise UsageError(str(exc)) from None
    print(json.dumps(r, indent=2) if args.json else format_result(r))
    return 0 if r["false_dead"] == 0 and (r["calls"] > 0 or args.idle) else 1


def _register_coordinator(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bsub.add_parser(
        "coordinator",
        help="the coordinator at cluster scale: N shard peers and P drivers on real sockets "
        "(exit 1: a peer wrongly declared dead)",
    )
    p.add_argument("--peers", type=positive_int, default=4096, help="shard peers (= devices)")
    p.add_argument("--pipelines", type=positive_int, default=256)
    p.add_argument("--duration", type=_positive_float, default=30.0, help="measured seconds")
    p.add_argument("--warmup", type=_positive_float, default=5.0, help="seconds before them")
    p.add_argument("--step-s", type=_positive_float, default=20.0, help="one RL step, seconds")
    p.add_argument(
        "--shard-delay-ms", type=_positive_float, default=200.0, help="a shard's sleep/wake/sync"
    )
    p.add_argument("--peer-procs", type=positive_int, help="default: one per 1,024 peers")
    p.add_argument("--driver-procs", type=positive_int, help="default: one per 128 pipelines")
    p.add_argument("--idle", action="store_true", help="no RL cycle: the cost of liveness alone")
    p.add_argument("--profile", help="run the coordinator under cProfile, stats to this file")
    p.add_argument("--coordinator-log", help="keep the coordinator's log in this file")
    p.add_argument("--snapshots", help="keep every 25th planner snapshot in this directory")
    p.add_argument(
        "--slow-callback-ms",
        type=_positive_float,
        help="asyncio debug mode in the coordinator: log every callback slower than this",
    )
    p.add_argument(
        "--coordinator-cpus",
        type=_cpu_list,
        help="pin the coordinator (and its planner process) to these CPUs, e.g. '1' or "
        "'2-3', and the simulated peers and drivers to the others: the coordinator with "
        "cores of its own, as on a cluster's head node",
    )
    _json_flag(p)
    p.set_defaults(func=_coordinator)


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON")


def _register_rpc(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bsub.add_parser("rpc", help="RPC round trip p50/p99 and throughput between processes")
    p.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    p.add_argument("--calls", type=positive_int, default=5000, help="sequential calls timed")
    p.add_argument("--window", type=positive_int, default=64, help="calls in flight for throughput")
    p.add_argument("--vs-ray", action="store_true", help="same pattern against a Ray actor")
    p.add_argument(
        "--pin",
        choices=["none", "shared", "split"],
        default="none",
        help="CPU placement: kernel's choice, client and server on one CPU, or one CPU each",
    )
    _json_flag(p)
    p.set_defaults(func=_rpc)


def _hosts_options(p: argparse.ArgumentParser) -> None:
    """``bench weights --hosts N``'s options (a version reaching N namespace hosts)."""
    p.add_argument(
        "--hosts",
        type=positive_int,
        help="receiving hosts (network namespaces, root): a version reaching every worker",
    )
    p.add_argument("--shards-per-host", type=positive_int, help="--hosts: shards on each (1)")
    p.add_argument("--tp", type=positive_int, help="--hosts: each shard's tensor-parallel size (1)")
    p.add_argument("--link-mbit", type=positive_int, help="--hosts: each link's rate (1000)")
    p.add_argument(
        "--path",
        choices=["node", "worker"],
        help="--hosts: node caches (default), or every worker pulling its own copy",
    )
    p.add_argument("--transport", choices=["sealed", "plain", "zmq"], help="--hosts: (sealed)")
    p.add_argument("--versions", type=positive_int, help="--hosts: timed versions (3)")
    p.add_argument(
        "--no-relay",
        action="store_true",
        help="--hosts: each node cache pulls from the owner (no relay chain)",
    )
    p.add_argument(
        "--wake-after",
        type=_positive_float,
        help="--hosts: shards sleep while each version is published, wake S seconds later",
    )
    p.add_argument(
        "--no-prefetch",
        action="store_true",
        help="--hosts: node caches pull only when a shard asks (weights.prefetch: false)",
    )
    p.add_argument(
        "--fault",
        choices=["kill-relay", "link-down"],
        help="--hosts: kill a relaying node's receiver, or take a link down 10 s, mid-version",
    )
    p.add_argument(
        "--delta",
        type=_fraction,
        help="--hosts: this fraction of the elements moves per version, sent as deltas",
    )


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    _register_rpc(bsub)
    p = bsub.add_parser("plan", help="planner latency on random realistic snapshots")
    p.add_argument("--gpus", type=positive_int, default=4096)
    p.add_argument("--pipelines", type=positive_int, default=256)
    p.add_argument("--snapshots", type=positive_int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fairness",
        choices=["finish_time", "demand"],
        default="finish_time",
        help="the planner's policy (Policy.fairness); finish_time snapshots carry paces",
    )
    _json_flag(p)
    p.set_defaults(func=_plan)
    p = bsub.add_parser(
        "engine", help="vLLM decode time against batch size, and the simulator's fitted curve"
    )
    p.add_argument("--model", help="HF directory (default: SmolLM2-135M-Instruct, converted)")
    p.add_argument("--batches", default="1,2,4,8,16", help="batch sizes, comma-separated")
    p.add_argument("--tokens", type=positive_int, default=24, help="decoded per request")
    p.add_argument("--repeats", type=positive_int, default=1, help="runs per point (median)")
    _json_flag(p)
    p.set_defaults(func=_engine)
    p = bsub.add_parser("weights", help="weight sync: shared memory, tcp, raw ZMQ, memcpy")
    p.add_argument(
        "--receiver",
        choices=["tensors", "vllm"],
        default="tensors",
        help="plain tensors (local, tcp, raw ZMQ), or a vLLM engine via load_version",
    )
    p.add_argument(
        "--size-mb", type=positive_int, help="weights (default 1024; vllm: 256, whole layers)"
    )
    p.add_argument("--bucket-mb", type=positive_int, default=64)
    p.add_argument("--credits", type=positive_int, help="tensors: buckets in flight (default 2)")
    p.add_argument("--rounds", type=positive_int, help="vllm: timed syncs (default 5)")
    p.add_argument(
        "--streams",
        type=positive_int,
        help="tensors, --hosts: tcp streams per transfer, as weights.streams (default 2)",
    )
    _hosts_options(p)
    _json_flag(p)
    p.set_defaults(func=_weights)
    p = bsub.add_parser(
        "gpu",
        help="CUDA: cache build and trainer offload/reload vs pinned copies (exit 1: a target missed)",
    )
    p.add_argument("--gib", type=_positive_float, default=2.0, help="bytes the cache builds from")
    p.add_argument("--model-mb", type=positive_int, default=400, help="trainer's bf16 weights")
    p.add_argument("--repeats", type=positive_int, default=3, help="timed runs (best is kept)")
    _json_flag(p)
    p.set_defaults(func=_gpu)
    _register_coordinator(bsub)
    p = bsub.add_parser("preempt", help="shrink a vLLM shard under load: latency, waste, losses")
    p.add_argument("--requests", type=positive_int, default=32, help="requests in flight")
    p.add_argument("--max-tokens", type=positive_int, default=96)
    p.add_argument("--rounds", type=positive_int, default=3, help="shrink/expand rounds")
    p.add_argument("--kv-cache-mb", type=positive_int, default=64, help="KV cache per engine (CPU)")
    _json_flag(p)
    p.set_defaults(func=_preempt)
    _register_episodes(bsub)
    _register_fuzz(bsub)
    register_transparency(bsub)
    register_delta(bsub)


def _register_fuzz(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bsub.add_parser(
        "fuzz",
        help="hostile connections against a listener, then a real use of it (exit 1: it "
        "stopped serving, lost bytes or leaked any)",
    )
    p.add_argument(
        "--target",
        choices=["stream", "env", "store"],
        default="stream",
        help="stream: the sealed weight stream's listener; env: broken environments in "
        "env worker processes against the driver's episode runner; store: the trainer "
        "ranks' sealed store while two ranks use it",
    )
    p.add_argument(
        "--inputs", type=positive_int, default=10_000, help="hostile connections or episodes"
    )
    p.add_argument(
        "--model", help="env: a directory whose tokenizer has a chat template (default: SmolLM2)"
    )
    p.add_argument("--seed", type=int, default=0)
    _json_flag(p)
    p.set_defaults(func=_fuzz)


def _register_episodes(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bsub.add_parser(
        "episodes",
        help="many concurrent env episodes on one driver loop: loop lag, heartbeat gaps "
        "(exit 1: an episode failed or a heartbeat gap reached the timeout)",
    )
    p.add_argument("--model", help="HF model directory with a chat template (default: SmolLM2)")
    p.add_argument("--episodes", type=positive_int, default=1000, help="run at once")
    p.add_argument("--turns", type=positive_int, default=3, help="model turns per episode")
    p.add_argument("--max-tokens", type=positive_int, default=4, help="per turn")
    p.add_argument("--kv-cache-mb", type=positive_int, default=1024, help="the engine's (CPU)")
    _json_flag(p)
    p.set_defaults(func=_episodes)
