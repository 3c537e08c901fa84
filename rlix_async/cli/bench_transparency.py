"""``rlix-async bench transparency [--pair]``: does time-sharing change what a recipe
learns, and (``--pair``) what does it save."""

from __future__ import annotations

import argparse
import json

from rlix_async.cli.args import UsageError, positive_int


def _transparency(args: argparse.Namespace) -> int:
    import sys

    from rlix_async.cli.args import check_output

    if args.out is None:  # the two benches never read each other's runs
        args.out = "rlix-transparency-pair" if args.pair else "rlix-transparency"
    check_output(args.out, directory=True)
    from rlix_async.bench.transparency import (
        TransparencyError,
        format_transparency,
        run_transparency,
    )
    from rlix_async.bench.transparency_pair import format_pair, run_pair_transparency
    from rlix_async.launch import LaunchError
    from rlix_async.models.pretrained import ModelError

    def progress(line: str) -> None:  # stdout stays the result's (--json: JSON only)
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    if len(set(args.seeds)) < 2:
        raise UsageError("--seeds: two at least (seed noise needs more than one seed)")
    steps = args.steps or (10 if args.pair else 8)  # the main demo's cadence with --pair
    every = args.eval_every or (5 if args.pair else 2)
    if every > steps:
        raise UsageError(f"--eval-every {every} is more than --steps {steps}: no eval to compare")
    try:
        if args.pair:
            result = run_pair_transparency(args.out, args.seeds, steps, every, progress)
        else:
            result = run_transparency(args.out, args.seeds, steps, every, progress)
    except (ModelError, LaunchError) as exc:  # a missing extra or model package
        raise UsageError(str(exc)) from None
    except TransparencyError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    text = format_pair(result) if args.pair else format_transparency(result)
    print(json.dumps(result, indent=2) if args.json else text)
    progress(f"wrote {args.out}/transparency.json and transparency.png")
    return 0 if result["transparent"] else 1


def register_transparency(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bsub.add_parser(
        "transparency",
        help="the arithmetic recipe alone vs time-shared, per seed: data order, batch sizes, "
        "staleness, eval curves (exit 1: time-sharing changed the recipe); --pair: the main "
        "demo's two recipes, each alone and both shared, and the wall time sharing saves",
    )
    p.add_argument(
        "--out", help="one directory per run in here (rlix-transparency; --pair: ...-pair)"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="two at least")
    p.add_argument(
        "--pair",
        action="store_true",
        help="the main demo's pipelines (arithmetic and arithmetic_agent) instead of the "
        "arithmetic recipe beside a neighbour",
    )
    p.add_argument("--steps", type=positive_int, help="recipe steps per run (8; with --pair 10)")
    p.add_argument("--eval-every", type=positive_int, help="(2; with --pair 5)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_transparency)
