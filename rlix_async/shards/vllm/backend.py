"""``engine.kind: vllm``: vLLM's ``AsyncLLM`` in the shard worker (shards/engines.py).

What vLLM needs from the rest of the package, said here and nowhere else: it runs on
CUDA where the shard sees CUDA devices; the installed version must be one this package
supports (``api.check_version``; serving adapters from memory also checks vLLM's
private LoRA interfaces); its CPU build pins its OpenMP threads through
``VLLM_CPU_OMP_THREADS_BIND``; its logs stay at warnings unless the user asks for
more; a base group's shard sizes its adapter slots for its largest group; and the
served model's tool calls are read by vLLM's own parsers (shards/vllm/tool_parsers.py).
Importing this module imports no vLLM.
"""

from __future__ import annotations

from typing import Any

import msgspec

from rlix_async.config import EngineConfig, VllmEngineConfig
from rlix_async.protocols.engine import ShardEngine, ToolCallFormat
from rlix_async.shards.engines import EngineStart, EngineUnavailable


class VllmBackend:
    binding_variable: str | None = "VLLM_CPU_OMP_THREADS_BIND"

    def check_installed(self, adapters: bool) -> str | None:
        from rlix_async.shards.vllm import api  # reads vLLM's metadata, imports nothing

        try:
            warning = api.check_version()
            if adapters:  # adapters from memory use vLLM internals: checked now
                api.check_internals()
        except api.VllmVersionError as exc:
            raise EngineUnavailable(str(exc)) from None
        return warning

    def uses_cuda(self, cuda_devices: int) -> bool:
        return cuda_devices > 0

    def environment(self) -> dict[str, str]:
        return {"VLLM_LOGGING_LEVEL": "WARNING"}

    def for_base_group(self, engine: EngineConfig, largest_group: int) -> EngineConfig:
        """Every member's old and new adapter version fit while a new one loads:
        ``max_loras`` twice the largest group unless set."""
        assert isinstance(engine, VllmEngineConfig)
        lora = msgspec.structs.replace(
            engine.lora, max_loras=engine.lora.max_loras or 2 * largest_group
        )
        return msgspec.structs.replace(engine, lora=lora)

    def build(self, start: EngineStart) -> ShardEngine:
        from rlix_async.shards.vllm.engine import VllmEngine

        assert isinstance(start.engine, VllmEngineConfig) and start.model is not None
        return VllmEngine(
            start.model,
            start.engine,
            seed=start.seed,
            tp=start.tp,
            cuda=start.cuda,
            keys_dir=start.keys_dir,
            key_name=start.key_name,
            lora=start.engine.lora if start.adapters else None,
            record_routes=start.record_routes,
        )

    def tool_parsers(self) -> frozenset[str] | None:
        from rlix_async.shards.vllm.tool_parsers import parser_names

        return parser_names()

    def tool_calls(self, parser: str | None, tokenizer: Any) -> ToolCallFormat:
        from rlix_async.shards.vllm.tool_parsers import DEFAULT, VllmToolCalls

        return VllmToolCalls(parser or DEFAULT, tokenizer)


BACKEND = VllmBackend()
