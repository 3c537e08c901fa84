"""vLLM general plugin: registers the ``rlix_shm`` weight-transfer backend.

vLLM loads ``vllm.general_plugins`` entry points in every process it starts
(the engine core included), which is where the backend must be known.
"""

from __future__ import annotations

BACKEND = "rlix_shm"


def register() -> None:
    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            BACKEND, "rlix_async.shards.vllm_transfer", "RlixShmTransferEngine"
        )
