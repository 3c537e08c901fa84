"""Our weight-transfer backend for vLLM (``WeightTransferConfig(backend="rlix_shm")``).

It runs inside vLLM's worker process. The update info is a
:class:`~rlix_async.weights.cache.CacheRef`: the worker maps the owner's
shared-memory slot (once; later syncs reuse the mapping), and feeds the model
bucket by bucket through ``model.load_weights`` inside vLLM's layerwise reload
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), the same path
vLLM's own IPC backend uses, so in-place loading also works on the CPU build.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlix_async.weights.cache import SHM_DIR, CacheRef
from rlix_async.weights.packing import Layout
from rlix_async.weights.sync import SlotOverwritten, SyncError, current_slot_ref, pull_blocking

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 20


@dataclass
class RlixInitInfo(WeightTransferInitInfo):
    shm_dir: str | None = None


@dataclass
class RlixUpdateInfo(WeightTransferUpdateInfo):
    pipeline: str
    owner: str
    version: str
    segment: str
    generation: int
    fingerprint: str
    total_bytes: int
    host: str
    server: str = ""


class _ModelSink:
    """Hands each bucket's tensors to vLLM's weight loader."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.version: str | None = None

    def start(self, version: str, layout: Layout) -> None:
        pass

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(named)

    def finish(self, version: str) -> None:
        self.version = version

    def abort(self) -> None:
        pass


class RlixShmTransferEngine(WeightTransferEngine[RlixInitInfo, RlixUpdateInfo]):
    init_info_cls = RlixInitInfo
    update_info_cls = RlixUpdateInfo
    supports_draft_weight_update = False

    shm_dir = SHM_DIR
    layout: Layout | None = None  # read from shared memory once per model layout
    loaded_version: str | None = None

    def init_transfer_engine(self, init_info: RlixInitInfo) -> None:
        from pathlib import Path

        if init_info.shm_dir:
            self.shm_dir = Path(init_info.shm_dir)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receive_weights(self, update_info: RlixUpdateInfo) -> None:
        """Load the version, or a newer one if the owner overwrote it meanwhile.

        A layerwise reload cannot be left half done (unloaded layers stay on
        the meta device), so a torn read is retried from the consistent
        version the slot now holds: every tensor is then loaded from it.
        """
        ref = msgspec.convert(update_info.__dict__, CacheRef)
        for _ in range(MAX_ATTEMPTS):
            try:
                self.layout = pull_blocking(
                    ref, _ModelSink(self.model), self.layout, shm_dir=self.shm_dir
                )
                self.loaded_version = ref.version
                return
            except SlotOverwritten as exc:
                logger.warning("%s; loading what the slot holds now", exc)
                time.sleep(0.01)
                ref = current_slot_ref(ref, self.shm_dir) or ref
        raise SyncError(
            f"no consistent version of {update_info.pipeline} after {MAX_ATTEMPTS} tries"
        )

    def shutdown(self) -> None:
        from rlix_async.weights.sync import forget_mappings

        forget_mappings()
