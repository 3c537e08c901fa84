"""Processes and jobs: ``coordinator``, ``shard``, ``node-cache``, ``launch``, ``demo``."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rlix_async.cli.args import (
    UsageError,
    add_overrides,
    check_endpoints,
    check_output,
    load_for,
    positive_int,
)
from rlix_async.recipes import RECIPES

if TYPE_CHECKING:
    from rlix_async.config import LaunchConfig

STOPPED = "stopped (every process and shared-memory segment cleaned up)"


def _coordinator(args: argparse.Namespace) -> int:
    from rlix_async.config import CoordinatorConfig

    cfg = load_for(CoordinatorConfig, args.config, args.overrides)
    check_endpoints(cfg, args.config or "the command line", ["endpoint"])
    if cfg.journal is not None:
        check_output(cfg.journal, parents=True)  # the coordinator creates its directory

    from rlix_async.aio import run  # the process's imports after its input is checked
    from rlix_async.coordinator_main import serve

    run(serve(cfg))
    return 0


def _shard(args: argparse.Namespace) -> int:
    from rlix_async.config import ShardConfig

    cfg = load_for(ShardConfig, args.config, args.overrides)
    source = args.config or "the command line"
    check_endpoints(cfg, source, ["coordinator", "data_endpoint"])
    model = cfg.model
    local = model is not None and model.startswith(("/", ".", "~"))  # a path, not a hub id
    if local and model is not None and not Path(model).expanduser().is_dir():
        raise UsageError(f"{source}: model: {model} is not a directory")

    from rlix_async.aio import run  # vLLM and torch: seconds, so after the checks
    from rlix_async.shards.shard_main import serve

    return run(serve(cfg))


def _node_cache(args: argparse.Namespace) -> int:
    if args.keys and not Path(args.keys).is_dir():
        raise UsageError(f"--keys: {args.keys} is not a directory")
    from rlix_async.aio import run
    from rlix_async.weights.node_main import serve

    run(serve(args.pipeline, args.keys, args.address or "", prefetch=not args.no_prefetch))
    return 0


def _supervised(job: Callable[[], None]) -> int:
    """Run a launcher job: Ctrl-C or SIGTERM (130) and failures (1) end in one line."""
    try:
        job()
    except KeyboardInterrupt:
        print(STOPPED, file=sys.stderr)
        return 130
    except RuntimeError as exc:
        from rlix_async.security import SecurityError

        if isinstance(exc, SecurityError):  # bad input, not a failed run: exit 2
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _dry_run(cfg: LaunchConfig, args: argparse.Namespace) -> int:
    """Print the placement without starting (or writing) anything."""
    import json

    from rlix_async.placement import (
        NodePlanError,
        bind_cores,
        bind_visible_devices,
        format_placement,
        place_processes,
        shard_cores,
    )
    from rlix_async.shards.engines import EngineUnavailable, engine_backend

    endpoint = "ipc://<coordinator.sock>" if cfg.cluster.nodes == 1 else "tcp://<head-node>:7600"
    try:
        plan = place_processes(cfg, Path(cfg.out).resolve(), endpoint, resume=args.resume)
        bind_visible_devices(plan, os.environ)
    except NodePlanError as exc:
        raise UsageError(str(exc)) from None
    try:
        binding = engine_backend(cfg.engine).binding_variable
    except EngineUnavailable as exc:
        raise UsageError(str(exc)) from None
    cores = shard_cores(binding)
    bind_cores(plan, cfg.cluster.gpus_per_node, cores, os.environ, binding)
    if args.json:
        print(json.dumps({"processes": [p.to_builtins() for p in plan]}, indent=2))
        return 0
    print(format_placement(plan, binding))
    if cores and cfg.cluster.nodes > 1:  # each node binds its shards to its own cores
        print(f"CPUS: as on this host ({len(cores)} cores); each node binds to its own")
    elif not cores and binding is not None and (bound := os.environ.get(binding)) is not None:
        print(f"CPUS: every process gets your {binding}={bound}")
    return 0


def check_engine(cfg: LaunchConfig) -> None:
    """Before any process starts: the engine can run here (exit 2, one line; e.g. a
    vLLM newer than those checked gets a one-line warning)."""
    from rlix_async.shards.engines import EngineUnavailable, engine_backend

    try:
        adapters = any(p.lora is not None for p in cfg.pipelines)
        backend = engine_backend(cfg.engine)
        warning = backend.check_installed(adapters)
        parsers = backend.tool_parsers()
    except EngineUnavailable as exc:
        raise UsageError(str(exc)) from None
    for p in cfg.pipelines:  # the agent endpoint's parser: the engine must have it
        parser = p.env.tool_call_parser
        if parser is not None and parsers is not None and parser not in parsers:
            raise UsageError(
                f"pipeline {p.id}: env.tool_call_parser {parser!r} is not one of this "
                f"engine's ({', '.join(sorted(parsers))})"
            )
    if warning:
        print(f"warning: {warning}", file=sys.stderr)


def _launch(args: argparse.Namespace) -> int:
    from rlix_async.config import LaunchConfig, load_config

    cfg: LaunchConfig = load_config(args.config, LaunchConfig, args.overrides)
    if args.dry_run:
        return _dry_run(cfg, args)
    if args.json:
        raise UsageError("--json goes with --dry-run")
    check_output(cfg.out, directory=True)
    check_engine(cfg)
    from rlix_async.launch import Launcher, LaunchError, NodeRole  # torch: after the checks

    node = None
    if args.node is not None:
        given = {
            "--coordinator": args.coordinator,
            "--address": args.address,
            "--keys": args.keys,
            "--job": args.job,
        }
        missing = [flag for flag, value in given.items() if not value]
        if missing:
            raise UsageError(
                f"--node needs {', '.join(missing)} (the same on every node but --address)"
            )
        node = NodeRole(args.node, args.coordinator, args.address, args.keys, args.job)
    elif args.coordinator or args.address or args.job or args.keys:
        raise UsageError("--coordinator, --address, --keys and --job go with --node K")
    try:
        launcher = Launcher(cfg, resume=args.resume, node=node)
    except LaunchError as exc:
        raise UsageError(str(exc)) from None
    code = _supervised(launcher.run)
    if code == 0:
        print(f"all pipelines finished; logs and metrics under {cfg.out}")
    return code


def _demo(args: argparse.Namespace) -> int:
    if args.quick and args.recipe:
        raise UsageError("--quick runs the tiny demo; --recipe a recipe: one or the other")
    if args.out is None:  # no demo overwrites another's run
        args.out = "rlix-quick" if args.quick else "rlix-recipe" if args.recipe else "rlix-demo"
    check_output(args.out, directory=True)
    from rlix_async.demo import MAIN, demo_config, format_summary, run_demo  # torch: after
    from rlix_async.launch import LaunchError
    from rlix_async.models.pretrained import ModelError

    recipe = None if args.quick else args.recipe or MAIN
    try:
        cfg = demo_config(args.out, args.steps, args.overrides, recipe)
    except ModelError as exc:  # the model's package or the `models` extra is missing
        raise UsageError(str(exc)) from None
    summaries = []
    try:
        code = _supervised(lambda: summaries.append(run_demo(cfg)))
    except LaunchError as exc:  # a recipe's data, reward or tokenizer did not load
        raise UsageError(str(exc)) from None
    if code:
        return code
    print(format_summary(summaries[0]))
    print(f"wrote {args.out}/summary.json, journal.jsonl, timeline.png, reward.png")
    return 0 if summaries[0]["lost_trajectories"] == 0 else 1


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("coordinator", help="run the coordinator (one per cluster)")
    p.add_argument("--config", help="CoordinatorConfig file (YAML/JSON); see docs/CONFIG.md")
    add_overrides(p, "cluster.gpus_per_node=4 journal=j.jsonl")
    p.set_defaults(func=_coordinator)

    p = sub.add_parser("shard", help="run one shard worker (inference engine) process")
    p.add_argument("--config", help="ShardConfig file (YAML/JSON); see docs/CONFIG.md")
    add_overrides(p, "pipeline=my-exp rank=0 model=DIR")
    p.set_defaults(func=_shard)

    p = sub.add_parser(
        "node-cache",
        help="receive a pipeline's weights once for this node (launch --node starts it)",
    )
    p.add_argument("--pipeline", required=True, help="the pipeline whose weights to receive")
    p.add_argument("--keys", help="the node's key directory (its shard key pulls the weights)")
    p.add_argument(
        "--address", help="this node's address: relay each version to the nodes behind it"
    )
    p.add_argument(
        "--no-prefetch",
        action="store_true",
        help="receive a version only when a shard here asks (weights.prefetch: false)",
    )
    p.set_defaults(func=_node_cache)

    p = sub.add_parser("launch", help="coordinator, shards and torchrun pipelines from a YAML")
    p.add_argument("config", help="LaunchConfig file, e.g. examples/pipelines.yaml")
    p.add_argument("--resume", action="store_true", help="pipelines continue from checkpoints")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print every process it would start (node, devices, CUDA_VISIBLE_DEVICES, argv) "
        "and start nothing",
    )
    p.add_argument("--json", action="store_true", help="with --dry-run: the plan as JSON")
    p.add_argument(
        "--node",
        type=int,
        metavar="K",
        help="run node K's share of a multi-node config (node 0 also runs the coordinator); "
        "run it on every node with the same config, coordinator, keys and job",
    )
    p.add_argument("--coordinator", metavar="tcp://HEAD:PORT", help="with --node: node 0's")
    p.add_argument("--address", metavar="IP", help="with --node: this node's, as others reach it")
    p.add_argument("--keys", metavar="DIR", help="with --node: the CURVE key directory")
    p.add_argument(
        "--job", help="with --node: this run's id, the same on every node, new for each run"
    )
    add_overrides(p, "pipelines[0].steps=20")
    p.set_defaults(func=_launch)

    _register_demo(sub)


def _register_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="the main job: two real recipes (arithmetic and an agent) time-sharing 3 CPU "
        "devices; --quick: the 5-minute tiny-model smoke; --recipe NAME: one recipe alone",
    )
    p.add_argument(
        "--out", help="output directory (rlix-demo; --quick: rlix-quick; --recipe: rlix-recipe)"
    )
    p.add_argument(
        "--steps",
        type=positive_int,
        help="training steps per pipeline (the main demo: its config's 10; else 15)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="two pipelines on a random tiny model over 4 CPU devices (about 5 minutes; "
        "needs only `bash scripts/setup.sh cpu`): time-sharing, no learning to speak of",
    )
    p.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        help="a packaged recipe (writes its data under OUT/data, converts its model once; "
        "the main job and recipes need `bash scripts/setup.sh cpu models recipes agents`); "
        "time_sharing is the main demo's pair",
    )
    add_overrides(p, "engine.kv_cache_mb=64")
    p.set_defaults(func=_demo)
