"""The ``rlix-async`` command: one subcommand per user-facing tool."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path


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
        transport=args.transport, calls=args.calls, window=args.window, vs_ray=args.vs_ray
    )
    result = run_rpc_bench(cfg)
    print(json.dumps(result, indent=2) if args.json else format_rpc_result(result))
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

    bench = sub.add_parser("bench", help="benchmarks that print figures")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    p = bsub.add_parser("rpc", help="RPC round trip p50/p99 and throughput between processes")
    p.add_argument("--transport", choices=["ipc", "tcp"], default="ipc")
    p.add_argument("--calls", type=int, default=5000, help="sequential calls timed")
    p.add_argument("--window", type=int, default=64, help="calls in flight for throughput")
    p.add_argument("--vs-ray", action="store_true", help="same pattern against a Ray actor")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_bench_rpc)
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
