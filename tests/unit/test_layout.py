"""The house rules, checked on the source: rooms import only downward, one struct per
concept, the CLI stays thin, files stay short. Each test names the rule it guards
(docs/ARCHITECTURE.md explains the rooms)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import msgspec
import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "rlix_async"

# The order of the rooms, bottom up (docs/ARCHITECTURE.md): foundation, control/topology
# and control/snapshot (the vocabulary), config, control, observe, weights, shards,
# hooks, train, rollout, then the processes and tools. Two deliberate reaches: control
# carries weights/ref.py's CacheRef (torch-free) on the wire, and the rollout collector
# fills train's replay buffer.
# config -> the only rlix_async modules it may import
# pure vocabularies the config package shares with the coordinator (no I/O, no torch)
CONFIG_MAY_IMPORT = {"control.topology", "control.snapshot", "control.cadence", "config"}
# room -> rooms it must never import (module prefixes under rlix_async)
FORBIDDEN = {
    "control": ["shards", "weights.cache", "weights.shm", "weights.tcp", "weights.pull",
                "train", "rollout", "cli", "pipeline", "launch", "demo", "sim", "bench",
                "hooks"],
    "observe": ["shards", "weights", "train", "rollout", "cli", "pipeline", "launch", "sim"],
    "weights": ["control", "shards", "train", "rollout", "observe", "cli", "pipeline",
                "launch", "hooks"],
    "shards": ["train", "rollout", "cli", "pipeline", "launch", "demo", "sim"],
    "train": ["rollout", "shards", "cli", "pipeline", "launch", "demo", "sim", "hooks"],
    "rollout": ["cli", "pipeline", "launch", "demo", "sim"],
    "transport": ["control", "shards", "weights", "train", "rollout", "config", "cli"],
}  # fmt: skip


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        out.append((".".join(rel.parts).removesuffix(".__init__"), path))
    return out


def _imports(path: Path) -> set[str]:
    """Every rlix_async module a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("rlix_async")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("rlix_async"):
            assert node.module is not None
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return {m.removeprefix("rlix_async.") for m in found}


def test_rooms_import_only_downward() -> None:
    broken = []
    for name, path in _modules():
        room = name.split(".")[0]
        if room == "config":
            broken += [
                f"{name} imports rlix_async.{m}"
                for m in _imports(path)
                if not any(m == ok or m.startswith(ok + ".") for ok in CONFIG_MAY_IMPORT)
                and m.rsplit(".", 1)[0] not in CONFIG_MAY_IMPORT  # `from x import Name`
            ]
        for imported in _imports(path):
            for bad in FORBIDDEN.get(room, []):
                if imported == bad or imported.startswith(bad + "."):
                    broken.append(f"{name} imports rlix_async.{imported}")
    assert not broken, "\n".join(broken)


def test_modules_import_by_full_name_not_through_the_root() -> None:
    """Relative imports and `from rlix_async import X` (the users' re-export) would hide
    a module's real dependencies from the rules above."""
    hidden = []
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                hidden.append(f"{name}: relative import")
            elif isinstance(node, ast.ImportFrom) and node.module == "rlix_async" and name:
                hidden.append(f"{name}: from rlix_async import ...")
    assert hidden == []


def test_every_exported_name_resolves() -> None:
    import rlix_async

    for name in rlix_async.__all__:
        assert getattr(rlix_async, name) is not None, name


def test_nothing_outside_the_cli_imports_it() -> None:
    users = [
        name
        for name, path in _modules()
        if not name.startswith("cli") and any(m.startswith("cli") for m in _imports(path))
    ]
    assert users == []


def test_one_struct_per_concept() -> None:
    """A (tp, devices) or (nodes, gpus_per_node) struct exists once: the topology's."""
    import importlib

    from rlix_async.control.topology import ClusterShape, ClusterSpec

    shapes: dict[frozenset[str], type] = {
        frozenset({"tp", "devices"}): ClusterSpec,
        frozenset({"nodes", "gpus_per_node"}): ClusterShape,
    }
    dupes = []
    for name, _ in _modules():
        if name.startswith(("shards.vllm", "train.megatron")) or name.endswith("__main__"):
            continue  # need vLLM / megatron-core, or run on import; they define no config
        module = importlib.import_module(f"rlix_async.{name}" if name else "rlix_async")
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, msgspec.Struct):
                owner = shapes.get(frozenset(obj.__struct_fields__))
                if owner is not None and obj is not owner:
                    dupes.append(f"{obj.__module__}.{obj.__qualname__} duplicates {owner}")
    assert dupes == []


def _functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [
        (node.name, (node.end_lineno or node.lineno) - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]


def test_the_cli_is_thin() -> None:
    """No process main in the CLI (they live beside their processes) and no long function."""
    long = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        long += [f"{path.name}:{n} ({lines} lines)" for n, lines in _functions(path) if lines > 60]
        text = path.read_text()
        for main in ("Coordinator(", "ShardWorker(", "RpcServer(", "Proc("):
            if main in text:
                long.append(f"{path.name} builds {main[:-1]} itself")
    assert long == []


@pytest.mark.parametrize("limit", [600])
def test_no_file_grows_past_the_limit(limit: int) -> None:
    big = [
        f"{name} ({n} lines)"
        for name, path in _modules()
        if (n := len(path.read_text().splitlines())) > limit
    ]
    assert big == [], f"split these by concern: {big}"


def test_bench_rpc_cli_defaults_are_the_config_defaults() -> None:
    """The one CLI whose options are not a config file: its choices and defaults must
    be RpcBenchConfig's (kept apart only so `rlix-async --help` stays light)."""
    from typing import get_args

    from rlix_async.bench.rpc import Pin, RpcBenchConfig, Transport
    from rlix_async.cli import build_parser

    args = build_parser().parse_args(["bench", "rpc"])
    cfg = RpcBenchConfig()
    assert (args.transport, args.calls, args.window, args.pin) == (
        cfg.transport,
        cfg.calls,
        cfg.window,
        cfg.pin,
    )
    bench = next(a for a in build_parser()._actions if a.dest == "command").choices["bench"]
    rpc = next(a for a in bench._actions if a.dest == "bench").choices["rpc"]
    choices = {a.dest: a.choices for a in rpc._actions if a.choices}
    assert tuple(choices["transport"]) == get_args(Transport)
    assert tuple(choices["pin"]) == get_args(Pin)


def test_no_reference_leaves_the_repository() -> None:
    """README, docs, launchers, examples and code cite only what is in the repository:
    no sibling directories (the source documents), no seed numbers, no web pages
    (loopback and the Perfetto UI a trace is opened in are tools, not references)."""
    import re

    root = PACKAGE.parent
    leaving = re.compile(
        r"\.\./shared|\bseeds?/|\(seed \d{3}\)|seed \d{3}\b|"
        r"https?://(?!127\.0\.0\.1|localhost|ui\.perfetto\.dev)"
    )
    files = [root / "README.md", *(root / "docs").glob("*.md")]
    folders = ("rlix_async", "launchers", "examples", "scripts")
    try:  # what the repository holds, not a run's output written under examples/
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", *folders],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        files += [root / name for name in listed if (root / name).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file
        for folder in folders:
            files += [p for p in (root / folder).rglob("*") if p.is_file()]
    files = [p for p in files if p.suffix != ".pyc"]
    found = [
        f"{path.relative_to(root)}:{n}: {line.strip()[:80]}"
        for path in files
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if leaving.search(line)
    ]
    assert found == []
