"""The house rules, checked on the source: rooms import only downward, one struct per
concept, the CLI stays thin, files stay short. Each test names the rule it guards
(docs/ARCHITECTURE.md explains the rooms)."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import msgspec

PACKAGE = Path(__file__).resolve().parents[2] / "rlix_async"

# The rooms, bottom up (docs/ARCHITECTURE.md, "Rooms"): a module imports only modules of
# its own room or of rooms below it, at the top of a file, under TYPE_CHECKING or inside
# a function alike (they are the same dependency). A room is a top-level module or
# package of rlix_async ("" is the package's own __init__, the users' re-export); a new
# room must be placed here to pass.
ROOMS = [
    # the foundation: typed messages, asyncio helpers, keys, user code by path, RPC
    "protocol",
    "aio",
    "security",
    "user_code",
    "transport",
    # the vocabulary every room shares: topology, plans, cadence, cache references,
    # the wire protocol, and the protocols rooms implement (engine, hooks, sinks)
    "protocols",
    "config",
    "control",
    "observe",
    "weights",
    "shards",
    "models",
    "train",
    "hooks",
    "rollout",
    "sim",
    "placement",
    "recipes",
    # the processes and the tools
    "coordinator_main",
    "pipeline",
    "remote_shards",
    "launch",
    "demo",
    "",
    "bench",
    "cli",
]
MAX_FUNCTION_LINES = 80  # a def's lines, docstring and comments included
MAX_FILE_LINES = 600


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        out.append((".".join(rel.parts).removesuffix("__init__").removesuffix("."), path))
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
    return {m.removeprefix("rlix_async").removeprefix(".") for m in found}


def _graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from m import name`` of a module
    counts as that module)."""
    names = {name for name, _ in _modules()}
    return {name: (_imports(path) & names) - {name} for name, path in _modules()}


def _room(module: str) -> str:
    return module.split(".")[0]


def test_every_room_is_placed() -> None:
    unplaced = sorted({_room(name) for name, _ in _modules()} - set(ROOMS))
    assert unplaced == [], f"place these rooms in ROOMS (bottom up): {unplaced}"


def test_rooms_import_only_downward() -> None:
    up = [
        f"{name} imports rlix_async.{dep}"
        for name, deps in _graph().items()
        for dep in sorted(deps)
        if ROOMS.index(_room(dep)) > ROOMS.index(_room(name))
    ]
    assert up == [], "\n".join(up)


def test_no_circle_of_files() -> None:
    """Tarjan's strongly connected components over the import graph: none larger than
    one file."""
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


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

    from rlix_async.protocols.topology import ClusterShape, ClusterSpec

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


def test_no_function_grows_past_the_limit() -> None:
    long = [
        f"{path.relative_to(PACKAGE)}:{name} ({lines} lines)"
        for _, path in _modules()
        for name, lines in _functions(path)
        if lines > MAX_FUNCTION_LINES
    ]
    assert long == [], f"split these by concept (limit {MAX_FUNCTION_LINES}): {long}"


def test_the_cli_is_thin() -> None:
    """No process main in the CLI (they live beside their processes)."""
    mains = []
    for path in sorted((PACKAGE / "cli").glob("*.py")):
        text = path.read_text()
        for main in ("Coordinator(", "ShardWorker(", "RpcServer(", "Proc("):
            if main in text:
                mains.append(f"{path.name} builds {main[:-1]} itself")
    assert mains == []


def test_no_file_grows_past_the_limit() -> None:
    big = [
        f"{name} ({n} lines)"
        for name, path in _modules()
        if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES
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
