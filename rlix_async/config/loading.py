"""Reading a config: YAML/JSON, ``KEY.PATH=VALUE`` overrides, one-line errors.

Every validation error becomes ``FILE: field: what is wrong``: msgspec's
message with its ``$.path`` turned into the field's dotted name, a rule of
ours (a struct's ``__post_init__`` raising ``"field: what"``) placed under
the struct that raised it, unknown keys with the closest known one (or where
a key of an earlier version lives now), invalid values with the choices.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class ConfigError(ValueError):
    """A config that cannot be used; the message is one line: ``FILE: field: problem``."""


def load_config(path: str | Path, kind: type[T], overrides: Sequence[str] = ()) -> T:
    """Read a YAML/JSON file as ``kind``, with ``key.path=value`` overrides applied."""
    import yaml

    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    return convert(raw if raw is not None else {}, kind, str(path), overrides)


def convert(raw: Any, kind: type[T], source: str, overrides: Sequence[str] = ()) -> T:
    """Validate plain data (a parsed file, a dict) as ``kind``; errors name ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level")
    for item in overrides:
        apply_override(raw, item, source, kind)
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {explain(str(exc), kind)}") from None


_INDEX = re.compile(r"^(\w[\w\-]*)((?:\[\d+\])*)$")


def _path_parts(key: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in key.split("."):
        m = _INDEX.match(piece)
        if m is None:
            raise ValueError(piece)
        parts.append(m.group(1))
        parts += [int(i) for i in re.findall(r"\[(\d+)\]", m.group(2))]
    return parts


def apply_override(
    raw: dict[str, Any], item: str, source: str, kind: type[msgspec.Struct] | None = None
) -> None:
    """``a.b[0].c=VALUE``: VALUE is parsed as YAML (``3``, ``true``, ``[0, 1]``, ``{...}``).

    A section the file leaves out starts from its default (``cluster.nodes=2`` keeps
    the default ``gpus_per_node``), so an override changes one key, nothing else."""
    import yaml

    key, sep, value = item.partition("=")
    try:
        if not sep:
            raise ValueError(item)
        parts = _path_parts(key.strip())
        parsed = yaml.safe_load(value) if value.strip() else None
    except (ValueError, yaml.YAMLError):
        raise ConfigError(f"override {item!r}: expected KEY.PATH=VALUE") from None
    node: Any = raw
    for i, part in enumerate(parts[:-1]):
        try:
            if isinstance(part, str) and part not in node:
                node[part] = _section_default(kind, parts[: i + 1], parts[i + 1])
            node = node[part]
        except (IndexError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"override {item!r}: {source} has no {key}") from None
    try:
        node[parts[-1]] = parsed
    except (IndexError, TypeError):
        raise ConfigError(f"override {item!r}: {source} has no {key}") from None


def _section_default(
    kind: type[msgspec.Struct] | None, path: list[str | int], nxt: str | int
) -> Any:
    """What a section missing from the file starts from: its default, as plain data."""
    empty: Any = [] if isinstance(nxt, int) else {}
    if kind is None:
        return empty
    import msgspec.inspect as mi

    nodes: list[Any] = [mi.type_info(kind)]
    default: Any = None
    for part in path:
        found: list[Any] = []
        default = None
        for t in (u for n in nodes for u in _unwrap(n)):
            if isinstance(part, int) and isinstance(t, mi.ListType):
                found.append(t.item_type)
            elif isinstance(t, mi.StructType):
                for f in t.fields:
                    if f.name != part:
                        continue
                    found.append(f.type)
                    if f.default is not mi.NODEFAULT:
                        default = f.default
                    elif f.default_factory is not mi.NODEFAULT:
                        default = f.default_factory()
        nodes = found
    if isinstance(default, msgspec.Struct | dict | list):
        return msgspec.to_builtins(default)
    return empty


def explain(message: str, kind: type[msgspec.Struct]) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.steps`" as "steps: expected int >= 1"."""
    m = re.match(r"^(.*?) - at `(key` in `)?\$([^`]*)`$", message, re.S)
    text, is_key, path = (
        (m.group(1), bool(m.group(2)), m.group(3).lstrip("."))
        if m
        else (
            message,
            False,
            "",
        )
    )
    own = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", text)
    if own:  # a rule of ours, naming its field relative to the struct that raised it
        path, text = _join(path, own.group(1)), own.group(2)
    elif m := re.match(r"Object contains unknown field `(.+)`", text):
        path, text = _join(path, m.group(1)), "unknown key" + _suggest(m.group(1), kind, path)
    elif m := re.match(r"Object missing required field `(.+)`", text):
        path, text = _join(path, m.group(1)), "required, missing"
    elif m := re.match(r"Invalid (?:enum )?value (.+)", text):
        choices = _choices(kind, path, is_key)
        what = "key" if is_key else "value"
        text = f"invalid {what} {m.group(1)}" + (
            f" (one of {', '.join(choices)})" if choices else ""
        )
    else:
        text = text.replace("`", "")
        text = text[:1].lower() + text[1:]
    return f"{path}: {text}" if path else text


def _join(path: str, field: str) -> str:
    return f"{path}.{field}" if path else field


def _type_at(kind: type[msgspec.Struct], path: str) -> list[Any]:
    """The msgspec.inspect types a path may lead to (several through a union)."""
    import msgspec.inspect as mi

    nodes: list[Any] = [mi.type_info(kind)]
    try:
        parts = _path_parts(path) if path else []
    except ValueError:
        return []
    for part in parts:
        nxt: list[Any] = []
        for node in nodes:
            for t in _unwrap(node):
                if isinstance(part, int) and isinstance(t, mi.ListType | mi.VarTupleType):
                    nxt.append(t.item_type)
                elif isinstance(t, mi.StructType):
                    nxt += [f.type for f in t.fields if f.name == part]
                elif isinstance(t, mi.DictType):
                    nxt.append(t.value_type)
        nodes = nxt
    return nodes


def _unwrap(t: Any) -> list[Any]:
    import msgspec.inspect as mi

    if isinstance(t, mi.Metadata):
        return _unwrap(t.type)
    if isinstance(t, mi.UnionType):
        return [u for member in t.types for u in _unwrap(member)]
    return [t]


def _choices(kind: type[msgspec.Struct], path: str, is_key: bool = False) -> list[str]:
    import msgspec.inspect as mi

    parent, _, last = path.rpartition(".")
    out: list[str] = []
    for node in _type_at(kind, path):
        for t in _unwrap(node):
            if is_key and isinstance(t, mi.DictType):
                t = t.key_type
            for lit in _unwrap(t):
                if isinstance(lit, mi.LiteralType):
                    out += [str(v) for v in lit.values]
    if not out and last:  # a tag: the struct types of the union hold the choices
        for node in _type_at(kind, parent):
            out += [str(t.tag) for t in _unwrap(node) if isinstance(t, mi.StructType) and t.tag]
    return sorted(set(out))


# Keys of earlier versions, and where they live now.
MOVED = {
    "max_staleness": "max_trajectory_age_steps",
    "groups_per_step": "rollout.groups_per_step",
    "group_size": "rollout.group_size",
    "max_tokens": "rollout.max_tokens",
    "temperature": "rollout.temperature",
    "max_groups_in_flight": "rollout.max_groups_in_flight",
    "lr": "train.lr",
    "loss": "train.loss.kind",
    "backend": "train.backend",
    "model_path": "model.path",
    "shard": "engine",
    "lease_timeout_s": "scheduler.lease_timeout_s",
}


def _suggest(name: str, kind: type[msgspec.Struct], path: str) -> str:
    import difflib

    import msgspec.inspect as mi

    if name in MOVED:
        return f" (it is {MOVED[name]} now)"

    known = sorted(
        {
            f.name
            for node in _type_at(kind, path)
            for t in _unwrap(node)
            if isinstance(t, mi.StructType)
            for f in t.fields
        }
    )
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" (known: {', '.join(known)})" if known else ""


def dump(cfg: msgspec.Struct) -> str:
    """The config as YAML, every default written out (what a process will run with)."""
    return msgspec.yaml.encode(cfg).decode()
