"""Processes and jobs: ``coordinator``, ``shard``, ``launch``, ``demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from rlix_async.cli import add_overrides, load_for, positive_int

STOPPED = "stopped (every process and shared-memory segment cleaned up)"


def _coordinator(args: argparse.Namespace) -> int:
    from rlix_async.aio import run
    from rlix_async.config import CoordinatorConfig
    from rlix_async.control.coordinator import serve

    run(serve(load_for(CoordinatorConfig, args.config, args.overrides)))
    return 0


def _shard(args: argparse.Namespace) -> int:
    from rlix_async.aio import run
    from rlix_async.config import ShardConfig
    from rlix_async.shards.worker import serve

    return run(serve(load_for(ShardConfig, args.config, args.overrides)))


def _supervised(job: Callable[[], None]) -> int:
    """Run a launcher job: Ctrl-C or SIGTERM (130) and failures (1) end in one line."""
    try:
        job()
    except KeyboardInterrupt:
        print(STOPPED, file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


def _launch(args: argparse.Namespace) -> int:
    from rlix_async.config import LaunchConfig, load_config
    from rlix_async.launch import Launcher

    cfg = load_config(args.config, LaunchConfig, args.overrides)
    code = _supervised(Launcher(cfg, resume=args.resume).run)
    if code == 0:
        print(f"all pipelines finished; logs and metrics under {cfg.out}")
    return code


def _demo(args: argparse.Namespace) -> int:
    from rlix_async.demo import format_summary, run_demo

    summaries = []
    code = _supervised(lambda: summaries.append(run_demo(args.out, args.steps, args.overrides)))
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

    p = sub.add_parser("launch", help="coordinator, shards and torchrun pipelines from a YAML")
    p.add_argument("config", help="LaunchConfig file, e.g. examples/pipelines.yaml")
    p.add_argument("--resume", action="store_true", help="pipelines continue from checkpoints")
    add_overrides(p, "pipelines[0].steps=20")
    p.set_defaults(func=_launch)

    p = sub.add_parser("demo", help="two GRPO pipelines time-sharing 4 CPU devices (main job)")
    p.add_argument("--out", default="rlix-demo", help="output directory")
    p.add_argument("--steps", type=positive_int, default=15, help="training steps per pipeline")
    add_overrides(p, "engine.kv_cache_mb=64")
    p.set_defaults(func=_demo)
