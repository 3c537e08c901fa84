"""What this package adds to vLLM's worker processes (``worker_extension_cls``).

vLLM mixes the extension class into its worker class; the engine reaches its
methods with ``collective_rpc``, once per tensor-parallel rank. Every shard's
engine gets it: the LoRA methods serve a base group's adapters
(:class:`~rlix_async.shards.vllm.lora.RlixLoraWorker`), the others report what the
weight-transfer backend did (``rlix_last_load``) and measure the floor of a sync
(``rlix_reload_from_memory``: vLLM reloading a version already in the worker's own
memory, which ``rlix-async bench weights --receiver vllm`` sets a shard's sync
against). The ``rlix_routes_*`` methods record the experts a mixture-of-experts
model routed each token to (:class:`~rlix_async.shards.vllm.routes.RoutesWorker`).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from rlix_async.protocols.cache_ref import CacheRef
from rlix_async.shards.vllm.lora import RlixLoraWorker
from rlix_async.shards.vllm.routes import RoutesWorker

EXTENSION = "rlix_async.shards.vllm.worker_extension.RlixWorker"


class RlixWorker(RlixLoraWorker, RoutesWorker):
    weight_transfer_engine: Any  # vLLM's worker attribute: our RlixShmTransferEngine
    finish_weight_update: Any  # vLLM's worker method (the class this extends)

    def rlix_last_load(self) -> dict[str, Any]:
        """How the last version reached the model: its version, seconds, and the path
        (``layerwise`` with the reason, or ``direct``)."""
        return dict(getattr(self.weight_transfer_engine, "last_load", {}) or {})

    def rlix_weight_session(self) -> dict[str, Any]:
        """This rank's part of the weight-update session in progress: the version it
        fetched (``ref``, None if nothing), whether its model changed already (a read
        in place) and the version its model holds."""
        transfer = self.weight_transfer_engine
        pending = getattr(transfer, "pending", None)
        return {
            "ref": msgspec.to_builtins(pending.ref) if pending is not None else None,
            "loaded": pending is not None and pending.loaded,
            "model_version": getattr(transfer, "model_version", None),
            "error": getattr(transfer, "error", None),
        }

    def rlix_end_weight_update(self) -> int | None:
        """End this rank's weight-update session whatever state a failure left it in:
        the fetched copy dropped, vLLM's session finished (its own ``update_weights``
        resets only the rank that raised, so a tensor-parallel peer would stay in a
        session and refuse every later ``start_weight_update``). Returns the version
        this rank's model holds."""
        transfer = self.weight_transfer_engine
        if transfer is None:
            return None
        transfer.abandon()
        if getattr(self, "_weight_update_active", False):  # vLLM's flag, read only
            self.finish_weight_update()  # nothing left to load: it only closes
        transfer.error = None
        return getattr(transfer, "model_version", None)

    def rlix_reload_from_memory(self, ref: dict[str, Any], rounds: int = 1) -> list[float]:
        """Seconds of each of ``rounds`` loads of version ``ref`` from a private copy in
        this worker's memory (made first, not timed), by the same path a sync takes.
        A benchmark's floor: the model's reload with no transfer at all."""
        from rlix_async.weights.staging import stage_version

        transfer = self.weight_transfer_engine
        _, transfer.layout, named = stage_version(
            msgspec.convert(ref, CacheRef), transfer.layout, keys=transfer.keys
        )
        seconds = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            transfer._load(named)
            seconds.append(time.perf_counter() - t0)
        return seconds
