"""The engine seam: engine.kind picks a backend (shards/engines.py), which says for itself
whether a shard runs it on CUDA; the shard's engine then gets that device's defaults.

The trap this guards: a shard once decided CUDA only for vLLM, so a custom engine on a
GPU got the CPU defaults (float32, a 64 MiB KV cache, built at start on a device a
trainer may hold)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlix_async.config import CustomEngineConfig, ShardConfig, VllmEngineConfig
from rlix_async.protocols.engine import ShardEngine, ToolCallFormat
from rlix_async.shards import shard_main
from rlix_async.shards.engines import (
    HERMES_ONLY,
    EngineStart,
    EngineUnavailable,
    PlainEngine,
    engine_backend,
    hermes_format,
)

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
SCRIPTED = f"{HELPERS / 'scripted_engine.py'}:ScriptedEngine"


class CpuOnly:
    """An engine backend that runs on the CPU even where the shard sees GPUs."""

    binding_variable: str | None = None

    def check_installed(self, adapters: bool) -> str | None:
        return "a warning line" if adapters else None

    def uses_cuda(self, cuda_devices: int) -> bool:
        return False

    def environment(self) -> dict[str, str]:
        return {"CPU_ONLY": "1"}

    def for_base_group(self, engine: object, largest_group: int) -> object:
        return engine

    def build(self, start: EngineStart) -> ShardEngine:
        raise AssertionError("not built in these tests")

    def tool_parsers(self) -> frozenset[str] | None:
        return HERMES_ONLY

    def tool_calls(self, parser: str | None, tokenizer: Any) -> ToolCallFormat:
        return hermes_format(parser, tokenizer)


CPU_ONLY = CpuOnly()


def _shard(custom: str) -> ShardConfig:
    return ShardConfig(pipeline="p", rank=0, devices=(0,), engine=CustomEngineConfig(custom=custom))


@pytest.mark.parametrize("seen", [0, 1])
def test_a_custom_engine_gets_the_defaults_of_the_device_it_says_it_runs_on(
    monkeypatch: pytest.MonkeyPatch, seen: int
) -> None:
    monkeypatch.setattr(shard_main, "cuda_device_count", lambda: seen)
    cfg = _shard(SCRIPTED)  # a plain ShardEngine class: on CUDA where CUDA devices are seen
    backend, cuda = shard_main.check_start(cfg)
    assert isinstance(backend, PlainEngine) and cuda == bool(seen)
    start = shard_main.engine_start(cfg, cuda)
    want = ("bfloat16", "first_wake") if seen else ("float32", "start")
    assert (start.engine.dtype, start.engine.load) == want and start.cuda == bool(seen)
    # a backend that says it runs on the CPU keeps the CPU defaults on a GPU node
    cpu = _shard(f"{__name__}:CPU_ONLY")
    backend, cuda = shard_main.check_start(cpu)
    assert backend is CPU_ONLY and not cuda
    assert shard_main.engine_start(cpu, cuda).engine.dtype == "float32"


def test_vllm_keeps_its_own_defaults_per_device() -> None:
    cfg = ShardConfig(pipeline="p", rank=0, model="m", engine=VllmEngineConfig())
    assert shard_main.engine_start(cfg, False).engine.kv_cache_mb == 64  # CPU: a fixed cache
    assert shard_main.engine_start(cfg, True).engine.kv_cache_mb is None  # CUDA: from memory


def test_an_engine_that_cannot_load_is_one_line() -> None:
    with pytest.raises(EngineUnavailable, match=r"^engine.custom: cannot import nope"):
        engine_backend(CustomEngineConfig(custom="nope:X"))
    with pytest.raises(EngineUnavailable, match=r"neither an engine backend \(it lacks .*\) nor"):
        engine_backend(CustomEngineConfig(custom=f"{__name__}:SCRIPTED"))  # a string
    # a backend written before tool_parsers: told what it lacks
    with pytest.raises(EngineUnavailable, match=r"\(it lacks tool_parsers\)"):
        engine_backend(CustomEngineConfig(custom=f"{__name__}:BEFORE_PARSERS"))


def test_choosing_the_vllm_backend_imports_no_vllm() -> None:
    """The driver asks the engine for its tool-call format and the launcher for its
    environment: neither may pay vLLM's import (seconds, and a CUDA probe)."""
    probe = (
        "import sys\n"
        "from rlix_async.config import VllmEngineConfig\n"
        "from rlix_async.shards.engines import engine_backend\n"
        "b = engine_backend(VllmEngineConfig())\n"
        "b.tool_calls(None, None); b.tool_parsers(); b.environment(); b.uses_cuda(0)\n"
        "print(b.binding_variable, 'vllm' in sys.modules, 'torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["VLLM_CPU_OMP_THREADS_BIND", "False", "False"]


def test_a_launch_refuses_an_engine_that_cannot_run_here(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """check_installed's refusal is one line and exit 2, before any process starts."""
    from rlix_async.cli import main

    cfg = tmp_path / "l.yaml"
    cfg.write_text(
        f"""
out: {tmp_path / "out"}
cluster: {{nodes: 1, gpus_per_node: 1}}
engine: {{kind: custom, custom: "{Path(__file__).resolve()}:REFUSING"}}
pipelines:
  - id: p
    clusters: {{actor_train: {{devices: [0]}}, actor_infer: {{devices: [0]}}}}
"""
    )
    assert main(["launch", str(cfg)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == "error: this engine needs a library this machine lacks"
    assert not (tmp_path / "out" / "logs").exists()


class Refusing(CpuOnly):
    def check_installed(self, adapters: bool) -> str | None:
        raise EngineUnavailable("this engine needs a library this machine lacks")


REFUSING = Refusing()


class BeforeParsers:
    """A backend of the protocol before ``tool_parsers`` was added."""

    binding_variable = None
    check_installed = CpuOnly.check_installed
    uses_cuda = CpuOnly.uses_cuda
    environment = CpuOnly.environment
    for_base_group = CpuOnly.for_base_group
    build = CpuOnly.build
    tool_calls = CpuOnly.tool_calls


BEFORE_PARSERS = BeforeParsers()
