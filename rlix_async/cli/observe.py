"""A running cluster and its journal: ``status``, ``kill``, ``timeline``."""

from __future__ import annotations

import argparse

from rlix_async.cli import UsageError


def _status(args: argparse.Namespace) -> int:
    from rlix_async.aio import run
    from rlix_async.observe.status import show_status

    return run(show_status(args.endpoint, args.keys, watch=args.watch, interval=args.interval))


def _kill(args: argparse.Namespace) -> int:
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


def _timeline(args: argparse.Namespace) -> int:
    from rlix_async.observe.timeline import draw_timeline

    try:
        out = draw_timeline(args.journal, args.output)
    except OSError as exc:
        raise UsageError(f"cannot read {args.journal}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(out)
    return 0


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", help="coordinator endpoint (default: local ipc)")
    p.add_argument("--keys", help="CURVE key directory for tcp://")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", help="devices x pipelines, live from the coordinator")
    _client_args(p)
    p.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.set_defaults(func=_status)

    p = sub.add_parser("kill", help="drop a pipeline and release everything it holds")
    p.add_argument("pipeline")
    _client_args(p)
    p.set_defaults(func=_kill)

    p = sub.add_parser("timeline", help="per-device Gantt chart of a journal")
    p.add_argument("journal")
    p.add_argument("-o", "--output", default="timeline.png")
    p.set_defaults(func=_timeline)
