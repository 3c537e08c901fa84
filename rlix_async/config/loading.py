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


# YAML 1.2's float (core schema): ``1e-6`` and ``1e-05`` are numbers. PyYAML reads
# YAML 1.1, where an exponent needs a dot in the mantissa ("1.0e-6"), so the learning
# rates every verl or NeMo RL config writes, and ``json.dumps(1e-5)``, were strings.
_FLOAT_12 = re.compile(
    r"""^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_loader: Any = None


def read_yaml(text: str) -> Any:
    """Parse YAML (or JSON) as users write configs: PyYAML's safe loader (YAML 1.1
    booleans, ``yes``/``on`` included, as before) with YAML 1.2 floats."""
    global _loader
    import yaml

    if _loader is None:

        class Loader(yaml.SafeLoader):
            pass

        # resolvers are looked up by first character: an exponent float may start
        # with a digit, a sign or a dot (the YAML 1.1 ones stay, ints first)
        Loader.yaml_implicit_resolvers = {
            k: list(v) for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
        }
        for first in "-+.0123456789":
            resolvers = Loader.yaml_implicit_resolvers.setdefault(first, [])
            ints = [r for r in resolvers if r[0] == "tag:yaml.org,2002:int"]
            rest = [r for r in resolvers if r[0] != "tag:yaml.org,2002:int"]
            Loader.yaml_implicit_resolvers[first] = [
                *ints,
                ("tag:yaml.org,2002:float", _FLOAT_12),
                *rest,
            ]
        _loader = Loader
    return yaml.load(text, Loader=_loader)


def load_config(path: str | Path, kind: type[T], overrides: Sequence[str] = ()) -> T:
    """Read a YAML/JSON file as ``kind``, with ``key.path=value`` overrides applied."""
    import yaml

    try:
        raw = read_yaml(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (UTF-8 YAML or JSON expected)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
    return convert(raw if raw is not None else {}, kind, str(path), overrides)


def convert(raw: Any, kind: type[T], source: str, overrides: Sequence[str] = ()) -> T:
    """Validate plain data (a parsed file, a dict) as ``kind``; errors name ``source``."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of keys at the top level")
    if overrides:
        import copy

        raw = copy.deepcopy(raw)  # the caller's data stays as it was
    for item in overrides:
        apply_override(raw, item, source, kind)
    raw = with_default_tags(raw, kind)
    try:
        return msgspec.convert(raw, kind)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {explain(str(exc), kind, raw)}") from None


def with_default_tags(raw: Any, kind: type[msgspec.Struct]) -> Any:
    """``raw`` with the tag of every tagged section that leaves it out filled in from
    the field's default (``engine`` without ``kind`` is the default engine's kind,
    ``train`` without ``backend`` the torch backend's): msgspec refuses a tagged union
    whose tag is missing, and configs written before the sections were unions name
    none. A copy where anything is filled; ``raw`` itself is left as it was."""
    import msgspec.inspect as mi

    return _fill(raw, mi.type_info(kind))


def _fill(raw: Any, t: Any) -> Any:
    import msgspec.inspect as mi

    members = _unwrap(t)
    if isinstance(raw, list):
        items = [m.item_type for m in members if isinstance(m, mi.ListType | mi.VarTupleType)]
        return [_fill(r, items[0]) for r in raw] if len(items) == 1 else raw
    if not isinstance(raw, dict):
        return raw
    values = [m.value_type for m in members if isinstance(m, mi.DictType)]
    if values:
        return {k: _fill(v, values[0]) for k, v in raw.items()}
    structs = _chosen_member([m for m in members if isinstance(m, mi.StructType)], raw)
    if len(structs) != 1:
        return raw
    out = dict(raw)
    for f in structs[0].fields:
        if f.encode_name not in out:
            continue
        value = out[f.encode_name]
        tagged = [u for u in _unwrap(f.type) if isinstance(u, mi.StructType) and u.tag_field]
        default_tag = _default_tag(f)
        if isinstance(value, dict) and tagged and default_tag is not None:
            field = tagged[0].tag_field
            if field not in value:
                value = {field: default_tag, **value}
        out[f.encode_name] = _fill(value, f.type)
    return out


def _default_tag(f: Any) -> Any:
    """The tag of a field's default value, when that is a tagged struct (else None)."""
    import msgspec.inspect as mi

    default = f.default if f.default is not mi.NODEFAULT else None
    if default is None and f.default_factory is not mi.NODEFAULT:
        default = f.default_factory()
    if not isinstance(default, msgspec.Struct):
        return None
    info = mi.type_info(type(default))
    return info.tag if isinstance(info, mi.StructType) and info.tag_field else None


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
        parsed = read_yaml(value) if value.strip() else None
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
    import msgspec.inspect as mi

    name = path[-1]
    for t in (u for n in (_type_at(kind, path[:-1]) if kind else []) for u in _unwrap(n)):
        for f in t.fields if isinstance(t, mi.StructType) else ():
            if f.name != name:
                continue
            if f.default is not mi.NODEFAULT:
                default = f.default
            elif f.default_factory is not mi.NODEFAULT:
                default = f.default_factory()
            else:
                continue
            if isinstance(default, msgspec.Struct) and default.__struct_config__.tag_field:
                # a tagged section (engine, train): its members' defaults, not the default
                # member's keys, so an override may choose another member (engine.kind=custom)
                return {}
            if isinstance(default, msgspec.Struct | dict | list):
                return msgspec.to_builtins(default)
    return [] if isinstance(nxt, int) else {}


def explain(message: str, kind: type[msgspec.Struct], raw: Any = None) -> str:
    """msgspec's "Expected `int` >= 1 - at `$.steps`" as "steps: expected int >= 1".

    ``raw`` (the data that failed) names the dict key msgspec writes as ``[...]``
    and picks the member of a tagged union the data chose."""
    m = re.match(r"^(.*?) - at `(key` in `)?\$([^`]*)`$", message, re.S)
    text, is_key, path = (m.group(1), bool(m.group(2)), m.group(3)) if m else (message, False, "")
    path = _name_dict_keys(path, text, kind, raw).lstrip(".")
    own = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", text)
    if own:  # a rule of ours, naming its field relative to the struct that raised it
        path, text = _join(path, own.group(1)), own.group(2)
    elif m := re.match(r"Object contains unknown field `(.+)`", text):
        hint = _suggest(m.group(1), _type_at(kind, path, raw), _type_at(kind, path))
        path, text = _join(path, m.group(1)), "unknown key" + hint
    elif text == "Expected `object`, got `str`" and path.rpartition(".")[2] in BECAME_SECTIONS:
        text = BECAME_SECTIONS[path.rpartition(".")[2]]
    elif m := re.match(r"Object missing required field `(.+)`", text):
        path, text = _join(path, m.group(1)), "required, missing"
    elif m := re.match(r"Invalid (?:enum )?value (.+)", text):
        choices = _choices(kind, path, raw, is_key)
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


def _name_dict_keys(path: str, text: str, kind: type[msgspec.Struct], raw: Any) -> str:
    """``clusters[...].tp`` -> ``clusters.actor_infer.tp``. msgspec does not say which
    key failed: it is the one whose entry alone gives the same error."""
    import copy

    while "[...]" in path:
        prefix, _, rest = path.partition("[...]")
        where = prefix.lstrip(".")
        node, key = _raw_at(raw, where), "[?]"
        for k in node if isinstance(node, dict) else ():
            trial = copy.deepcopy(raw)
            entries = _raw_at(trial, where)
            for other in [o for o in entries if o != k]:
                del entries[other]
            try:
                msgspec.convert(trial, kind)
            except msgspec.ValidationError as exc:
                if str(exc).startswith(text) and f"{prefix}[...]" in str(exc):
                    key = f".{k}"
                    break
        path = prefix + key + rest
    return path


def _raw_at(raw: Any, path: str | list[str | int]) -> Any:
    try:
        for part in path if isinstance(path, list) else _path_parts(path) if path else []:
            raw = raw[part]
    except (ValueError, KeyError, IndexError, TypeError):
        return None
    return raw


def _type_at(kind: type[msgspec.Struct], path: str | list[str | int], raw: Any = None) -> list[Any]:
    """The msgspec.inspect types a path may lead to: several through a union, unless
    the data there names its member (a tagged union's tag)."""
    import msgspec.inspect as mi

    nodes: list[Any] = [mi.type_info(kind)]
    try:
        parts = path if isinstance(path, list) else _path_parts(path) if path else []
    except ValueError:
        return []
    for depth, part in enumerate(parts):
        nxt: list[Any] = []
        for t in (u for n in nodes for u in _unwrap(n)):
            if isinstance(part, int) and isinstance(t, mi.ListType | mi.VarTupleType):
                nxt.append(t.item_type)
            elif isinstance(t, mi.StructType):
                nxt += [f.type for f in t.fields if f.name == part]
            elif isinstance(t, mi.DictType):
                nxt.append(t.value_type)
        nodes = _chosen_member(nxt, _raw_at(raw, parts[: depth + 1]))
    return nodes


def _chosen_member(nodes: list[Any], data: Any) -> list[Any]:
    import msgspec.inspect as mi

    members = [u for n in nodes for u in _unwrap(n)]
    tagged = [t for t in members if isinstance(t, mi.StructType) and t.tag_field]
    if isinstance(data, dict) and tagged:
        chosen = [t for t in tagged if data.get(t.tag_field) == t.tag]
        if chosen:
            return chosen
    return nodes


def _unwrap(t: Any) -> list[Any]:
    import msgspec.inspect as mi

    if isinstance(t, mi.Metadata):
        return _unwrap(t.type)
    if isinstance(t, mi.UnionType):
        return [u for member in t.types for u in _unwrap(member)]
    return [t]


def _choices(kind: type[msgspec.Struct], path: str, raw: Any, is_key: bool) -> list[str]:
    import msgspec.inspect as mi

    parent, _, last = path.rpartition(".")
    out: list[str] = []
    for node in _type_at(kind, path, raw):
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


# Keys of the layout before rlix_async.config, per struct, and where they live now.
MOVED = {
    "PipelineConfig": {
        "groups_per_step": "rollout.groups_per_step",
        "group_size": "rollout.group_size",
        "max_tokens": "rollout.max_tokens",
        "temperature": "rollout.temperature",
        "max_groups_in_flight": "rollout.max_groups_in_flight",
        "lr": "train.lr",
        "loss": "train.loss.kind",
        "backend": "train.backend",
        "model_path": "model.path",
        "reward": "env.reward",
        "reward_args": "env.reward_args",
        "reward_timeout_s": "env.reward_timeout_s",
        "env_args": "env.env_args",
        "env_workers": "env.workers",
        "agent": "env.agent",
        "agent_api": "env.agent_api",
        "agent_api_host": "env.api_host",
        "agent_args": "env.agent_args",
        "max_turns": "env.max_turns",
        "max_episode_tokens": "env.max_episode_tokens",
        "fail_after_groups": "env.fail_after_groups",
        "env_step_timeout_s": "env.step_timeout_s",
        "episode_reward": "env.episode_reward",
    },
    "ScenarioPipeline": {"max_staleness": "max_trajectory_age_steps"},
    "LaunchConfig": {"shard": "engine", "lease_timeout_s": "scheduler.lease_timeout_s"},
    "EngineConfig": {"sleep_mode": "sleep_level; sleep mode is always on with CUDA"},
}


# Keys that held a string and name a section now.
BECAME_SECTIONS = {
    "env": "a section now: the environment class is env.env_class (env.reward, "
    "env.agent and env.agent_api sit beside it)",
}


def _suggest(name: str, nodes: list[Any], union: Sequence[Any] = ()) -> str:
    """Where a renamed key lives now, the member of a tagged union that has it (a key
    of another engine kind or trainer backend), else the closest known key."""
    import difflib

    import msgspec.inspect as mi

    structs = [t for n in nodes for t in _unwrap(n) if isinstance(t, mi.StructType)]
    for t in structs:
        moved = MOVED.get(t.cls.__name__, {}).get(name)
        if moved:
            return f" (it is {moved} now)"
    owners = [
        t
        for n in union
        for t in _unwrap(n)
        if isinstance(t, mi.StructType)
        and t.tag_field
        and t not in structs
        and any(f.encode_name == name for f in t.fields)
    ]
    if owners:
        t = owners[0]
        return f" (a key of {t.tag_field} {t.tag}, not {_tags(structs)})"
    known = sorted({f.name for t in structs for f in t.fields})
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f" (did you mean {close[0]}?)"
    return f" (known: {', '.join(known)})" if known else ""


def _tags(structs: list[Any]) -> str:
    return " or ".join(str(t.tag) for t in structs if t.tag_field) or "this section"


def dump(cfg: msgspec.Struct) -> str:
    """The config as YAML, every default written out (what a process will run with)."""
    return msgspec.yaml.encode(cfg).decode()
