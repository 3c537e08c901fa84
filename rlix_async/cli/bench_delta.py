"""``rlix-async bench delta --run DIR``: weight deltas on a real run's versions."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rlix_async.cli.args import UsageError


def _delta(args: argparse.Namespace) -> int:
    from rlix_async.bench.delta import DeltaBenchError, format_summary, summarize

    run = Path(args.run)
    if not run.is_dir():
        raise UsageError(f"--run {run}: not a directory")
    try:
        result = summarize(run)
    except DeltaBenchError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(result, indent=2) if args.json else format_summary(result))
    return 0


def register_delta(bsub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bsub.add_parser(
        "delta",
        help="weight deltas on a run's versions: changed fraction, bytes per encoding, cost",
    )
    p.add_argument(
        "--run", required=True, help="a pipeline's run directory, or a launch's out directory"
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(func=_delta)
