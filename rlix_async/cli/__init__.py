"""The ``rlix-async`` command: each subcommand's parser beside its handler.

Handlers are thin: they load a config (``rlix_async.config``), call the
process main or tool that lives next to the code it runs, and print. Bad
input (a config, a file, an argument) is one line on stderr and exit code 2;
any other failure is one line and exit code 1, with the traceback only under
``--debug``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit code 2."""


def load_for(kind: type[T], path: str | None, overrides: Sequence[str]) -> T:
    """A process config from ``--config FILE`` and ``KEY=VALUE`` overrides (defaults
    come from the config class; without a file, from the overrides alone)."""
    from rlix_async.config import convert, load_config

    if path is None:
        return convert({}, kind, "the command line", overrides)
    return load_config(path, kind, overrides)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def add_overrides(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="KEY=VALUE",
        help=f"set a config key (YAML value), e.g. {example}",
    )


def build_parser() -> argparse.ArgumentParser:
    from rlix_async.cli import bench, observe, processes, scheduling, setup

    parser = argparse.ArgumentParser(
        prog="rlix-async",
        description="Time-share GPUs between LLM RL pipelines (asyncio + ZMQ control plane).",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of failures")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (processes, scheduling, observe, setup, bench):
        module.register(sub)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Like ``parse_args``, except that ``KEY=VALUE`` overrides may also follow options
    (argparse stops filling a ``*`` positional at the first option)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from rlix_async.config import ConfigError
    from rlix_async.loading import LoadError
    from rlix_async.security import SecurityError

    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except (ConfigError, UsageError, LoadError, SecurityError) as exc:
        if args.debug:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"error: {type(exc).__name__}: {exc} (--debug shows where)", file=sys.stderr)
        return 1
