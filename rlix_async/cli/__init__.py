"""The ``rlix-async`` command: each subcommand's parser beside its handler.

Handlers are thin: they load a config (``rlix_async.config``), call the
process main or tool that lives next to the code it runs, and print.

Failures end in one line on stderr, decided in one place (:func:`explain`):

- exit 2, ``error: ...``: the user's input is wrong, nothing was done. A bad
  argument (argparse), a config (``ConfigError``), an endpoint or key directory
  (``SecurityError``, a malformed endpoint), an engine or class that cannot be
  imported (``LoadError``), what a handler refuses (``UsageError``), and a file or
  directory the command line names that cannot be read or written (an ``OSError``
  whose path is, or lies under, one given on the command line).
- exit 1, ``error: ...``: the command was right but could not finish: a
  coordinator that does not answer or refuses, a connection lost, any other
  ``OSError``.
- exit 1, ``error: internal error: TYPE: ...``: any other exception. Unexpected,
  most likely a bug of ours: the line says so, so it is never mistaken for bad
  input (nor hidden as exit 2).
- exit 130: Ctrl-C.

``--debug`` (anywhere on the line) prints the traceback before that line; the
exit code stays the same.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from rlix_async.cli.args import FAILED, USAGE, Parser, UsageError


def build_parser() -> argparse.ArgumentParser:
    from rlix_async.cli import bench, observe, processes, scheduling, setup

    parser = Parser(
        prog="rlix-async",
        description="Time-share GPUs between LLM RL pipelines (asyncio + ZMQ control plane).",
        epilog="Bad input exits 2 and other failures 1, each with one line on stderr; "
        "--debug (anywhere on the line) adds the traceback.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of failures")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in (processes, scheduling, observe, setup, bench):
        module.register(sub)
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Like ``parse_args``, except that ``KEY=VALUE`` overrides may also follow options
    (argparse stops filling a ``*`` positional at the first option), and ``--debug``
    and ``-v`` may also follow the subcommand, where one types them after a failure."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    for flag, dest in (("--debug", "debug"), ("-v", "verbose"), ("--verbose", "verbose")):
        while flag in extra:
            extra.remove(flag)
            setattr(args, dest, True)
    if extra:
        if hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _given_paths(args: argparse.Namespace) -> Iterator[str]:
    """Every path the command line may name, absolute: each string argument and each
    ``KEY=VALUE`` override's value."""
    for value in vars(args).values():
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str | Path):
                continue
            texts = {str(item)}
            if isinstance(item, str) and "=" in item:
                texts.add(item.partition("=")[2])
            yield from (os.path.abspath(os.path.expanduser(t)) for t in texts if t)


def _user_path(exc: OSError, args: argparse.Namespace) -> str | None:
    """The path of ``exc`` if the command line named it (or a directory above it)."""
    given = {p for p in _given_paths(args) if p != os.sep}
    for name in (exc.filename, exc.filename2):
        if isinstance(name, str | Path):
            path = os.path.abspath(os.fspath(name))
            if any(path == g or path.startswith(g + os.sep) for g in given):
                return os.fspath(name)
    return None


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(no message)"


def explain(exc: Exception, args: argparse.Namespace) -> tuple[int, str]:
    """The exit code and the one line for a failure (the rules: this module's doc)."""
    from rlix_async.config import ConfigError
    from rlix_async.protocol import RpcError
    from rlix_async.security import SecurityError
    from rlix_async.user_code import LoadError

    if isinstance(exc, UsageError | ConfigError | LoadError | SecurityError):
        return USAGE, f"error: {_one_line(str(exc))}"
    if isinstance(exc, OSError) and (path := _user_path(exc, args)) is not None:
        return USAGE, f"error: {path}: {exc.strerror or _one_line(str(exc))}"
    hint = " (--debug shows the traceback)"
    if isinstance(exc, ConnectionError | TimeoutError | RpcError):
        return FAILED, f"error: {_one_line(str(exc))}{hint}"  # their messages say what
    if isinstance(exc, OSError):
        return FAILED, f"error: {type(exc).__name__}: {_one_line(str(exc))}{hint}"
    what = f"{type(exc).__name__}: {_one_line(str(exc))}"
    return FAILED, f"error: internal error: {what[:400]} (--debug shows where)"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        code, line = explain(exc, args)
        if args.debug:
            traceback.print_exc()
        print(line, file=sys.stderr)
        return code
