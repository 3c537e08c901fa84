"""Load a user's object by path: ``package.module:attr`` or ``path/to/file.py:attr``.

How engines (``engine.custom``), and later reward functions and environments,
name code of their own in a config. A file path is taken relative to the
current directory; the file is imported as a module of its own name.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any


class LoadError(ImportError):
    """The object named by a spec cannot be loaded; the message says why, in one line."""


class CalledExit(RuntimeError):
    """User code (an env, agent or reward) called ``sys.exit()``: a failure of that call.

    Left as SystemExit it would leave the thread or task it ran in and end the
    driver's event loop, every pipeline's trajectories in flight with it."""

    def __init__(self, code: object) -> None:
        super().__init__(code)  # args: the code, so it pickles back from a worker as it was
        self.code = code

    def __str__(self) -> str:
        return f"called exit({self.code!r})"


def call_guarded(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its SystemExit a :class:`CalledExit` (for threads and workers)."""
    try:
        return fn(*args)
    except SystemExit as exc:
        raise CalledExit(exc.code) from None


async def await_guarded(awaitable: Awaitable[Any]) -> Any:
    """``await awaitable``, its SystemExit a :class:`CalledExit`."""
    try:
        return await awaitable
    except SystemExit as exc:
        raise CalledExit(exc.code) from None


def load_object(spec: str) -> Any:
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise LoadError(f"{spec!r}: expected 'package.module:name' or 'path/file.py:name'")
    module = _load_file(where) if where.endswith(".py") else _import(where)
    obj: Any = module
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LoadError(f"{spec!r}: {where} has no {attr!r}") from None
    return obj


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise LoadError(f"cannot import {name}: {exc}") from None


def _load_file(path: str) -> Any:
    file = Path(path).resolve()
    if not file.is_file():
        raise LoadError(f"{path}: no such file")
    # one module per file, whatever its name collides with
    name = f"rlix_user_{file.stem}_{hashlib.sha1(str(file).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise LoadError(f"{path}: failed to import: {type(exc).__name__}: {exc}") from exc
    return module
