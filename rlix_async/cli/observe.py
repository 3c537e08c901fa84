"""A running cluster and its journal: ``status``, ``kill``, ``timeline``, ``trace``."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rlix_async.cli.args import UsageError, check_output, endpoint_arg

if TYPE_CHECKING:
    from rlix_async.security import ClientKeys


def _coordinator(args: argparse.Namespace) -> tuple[str, ClientKeys | None]:
    """The coordinator's endpoint and our keys, refused here when they cannot work: a
    public ipc directory, tcp without keys, a key directory that is missing or open to
    others, an ipc socket that does not exist (no coordinator: the call would only
    time out)."""
    from rlix_async.security import ClientKeys, check_endpoint, ipc_endpoint

    endpoint = args.endpoint or ipc_endpoint("coordinator")
    keys = ClientKeys.load(args.keys) if args.keys else None
    check_endpoint(endpoint, keys)
    socket = endpoint.removeprefix("ipc://")
    if endpoint.startswith("ipc://") and not socket.startswith("@") and not Path(socket).exists():
        where = "" if args.endpoint else " (the default; --endpoint names another)"
        raise UsageError(f"no coordinator at {endpoint}{where}: no such socket")
    return endpoint, keys


def _status(args: argparse.Namespace) -> int:
    from rlix_async.aio import run
    from rlix_async.observe.status import show_status

    endpoint, keys = _coordinator(args)
    return run(show_status(endpoint, keys, watch=args.watch, interval=args.interval))


def _kill(args: argparse.Namespace) -> int:
    import uuid

    from rlix_async.aio import run
    from rlix_async.observe.status import fetch
    from rlix_async.protocols.messages import Unregister
    from rlix_async.transport import RpcClient

    endpoint, keys = _coordinator(args)

    async def main() -> None:
        async with RpcClient(endpoint, f"admin-{uuid.uuid4().hex[:6]}/cli/0", keys=keys) as c:
            known = sorted(p.id for p in (await fetch(c)).pipelines)
            if args.pipeline not in known:  # a typo would otherwise "succeed" silently
                raise UsageError(
                    f"no pipeline {args.pipeline!r} at {endpoint} "
                    f"(registered: {', '.join(known) or 'none'})"
                )
            await c.call(Unregister(pipeline_id=args.pipeline), timeout=10)

    run(main())
    print(f"{args.pipeline}: leases released, pipeline removed")
    return 0


def _journal_tool(args: argparse.Namespace, tool_name: str) -> int:
    """Run ``timeline`` or ``trace`` on a journal: a missing or unreadable journal, an
    output that cannot be written, a journal with nothing to show are bad input."""
    if tool_name == "trace":
        from rlix_async.observe.trace import write_trace

        tool = write_trace
    else:
        from rlix_async.observe.timeline import draw_timeline

        tool = draw_timeline

    check_output(args.output)
    try:
        out = tool(args.journal, args.output)
    except OSError as exc:
        if exc.filename is not None and Path(exc.filename) == Path(args.output):
            raise UsageError(f"cannot write {args.output}: {exc.strerror or exc}") from None
        raise UsageError(f"cannot read {args.journal}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    print(out)
    return 0


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--endpoint", type=endpoint_arg, help="coordinator endpoint (default: local ipc)"
    )
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
    p.set_defaults(func=lambda args: _journal_tool(args, "timeline"))

    p = sub.add_parser("trace", help="a journal as Chrome trace JSON: open it in ui.perfetto.dev")
    p.add_argument("journal", help="a coordinator's, launch's, demo's or simulate's journal")
    p.add_argument("-o", "--output", default="trace.json", help="the JSON to write")
    p.set_defaults(func=lambda args: _journal_tool(args, "trace"))
