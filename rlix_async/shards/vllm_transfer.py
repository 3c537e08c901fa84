"""Our weight-transfer backend for vLLM (``WeightTransferConfig(backend="rlix_shm")``).

It runs inside vLLM's worker process. The update info is a
:class:`~rlix_async.weights.cache.CacheRef`: the worker maps the owner's
shared-memory slot (once; later syncs reuse the mapping), and feeds the model
bucket by bucket through ``model.load_weights`` inside vLLM's layerwise reload
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), the same path
vLLM's own IPC backend uses, so in-place loading also works on the CPU build.
"""

from __future__ import annotations

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
from rlix_async.weights.sync import pull_blocking


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
        ref = msgspec.convert(update_info.__dict__, CacheRef)
        self.layout = pull_blocking(ref, _ModelSink(self.model), self.layout, shm_dir=self.shm_dir)

    def shutdown(self) -> None:
        from rlix_async.weights.sync import forget_mappings

        forget_mappings()
