"""What every subcommand's parser and handler share: the one-line usage error, the
argparse types, config loading with overrides, and the checks made before any work."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)

USAGE, FAILED = 2, 1  # exit codes: bad input; a run that could not finish (or a bug)


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (it prints the usage and the error on two
    or more); ``--help`` still shows the usage. Subcommand parsers are of this class too
    (``add_subparsers`` makes its parsers of the parent's class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"error: {message} (see {self.prog} --help)\n")


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


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with an endpoint's form, or None: ``ipc://PATH`` or
    ``tcp://HOST:PORT`` (``*`` for any port). Checked before a socket is made, whose
    error (ZMQ's ``Invalid argument``) names neither the rule nor the value."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("ipc", "tcp") or not rest:
        return f"unsupported endpoint {endpoint!r}: use ipc://PATH or tcp://HOST:PORT"
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and 0 < int(port) < 65536)):
            return f"{endpoint}: a tcp endpoint is tcp://HOST:PORT (PORT 1-65535)"
    return None


def endpoint_arg(text: str) -> str:
    """An argparse type: an endpoint of a valid form."""
    problem = endpoint_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def check_endpoints(cfg: msgspec.Struct, source: str, fields: Sequence[str]) -> None:
    """Refuse a config whose endpoint ``fields`` are malformed, naming the field."""
    for name in fields:
        value = getattr(cfg, name)
        problem = None if value is None else endpoint_problem(value)
        if problem is not None:
            raise UsageError(f"{source}: {name}: {problem}")


def check_output(path: str | Path, *, directory: bool = False, parents: bool = False) -> None:
    """Refuse, before any work is done, an output that cannot be written: a file that is
    a directory or whose directory is missing (unless ``parents``: it will be made), a
    directory (made with its parents) below something that is not a directory, or a
    place that is not writable."""
    p = Path(path).expanduser().absolute()
    if not directory and p.is_dir():
        raise UsageError(f"{path}: is a directory")
    base = p if directory else p.parent
    if directory or parents:
        while not base.exists():  # made, with what is missing above it
            base = base.parent
    elif not base.exists():
        raise UsageError(f"{path}: directory {base} does not exist")
    if not base.is_dir():
        raise UsageError(
            f"{path}: not a directory" if base == p else f"{path}: {base} is not a directory"
        )
    if not os.access(base, os.W_OK | os.X_OK):
        raise UsageError(f"{path}: {base} is not writable")
