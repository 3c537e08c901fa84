"""vLLM general plugin: registers the ``rlix_shm`` weight-transfer backend.

vLLM loads ``vllm.general_plugins`` entry points in every process it starts
(the engine core included), which is where the backend must be known.
"""

from __future__ import annotations

BACKEND = "rlix_shm"


def register() -> None:
    from rlix_async.shards.vllm import api as vllm_api

    vllm_api.register_transfer_backend(
        BACKEND, "rlix_async.shards.vllm.transfer", "RlixShmTransferEngine"
    )
