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
from pathlib import Path
from typing import Any


class LoadError(ImportError):
    """The object named by a spec cannot be loaded; the message says why, in one line."""


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
