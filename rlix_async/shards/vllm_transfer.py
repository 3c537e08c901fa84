"""Our weight-transfer backend for vLLM (``WeightTransferConfig(backend="rlix_shm")``).

It runs inside vLLM's worker process. The update info is a
:class:`~rlix_async.weights.ref.CacheRef`: the worker maps the owner's
shared-memory slot (once; later syncs reuse the mapping), and feeds the model
its tensors through ``model.load_weights`` inside vLLM's layerwise reload
(``initialize_layerwise_reload`` / ``finalize_layerwise_reload``), the same path
vLLM's own IPC backend uses, so in-place loading also works on the CPU build.
Each version is staged in private memory first (see ``receive_weights``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from rlix_async.security import ClientKeys
from rlix_async.weights.packing import Layout
from rlix_async.weights.pull import pull_blocking
from rlix_async.weights.ref import CacheRef
from rlix_async.weights.shm import SHM_DIR, current_slot_ref, forget_mappings
from rlix_async.weights.sinks import SlotOverwritten, SyncError

logger = logging.getLogger(__name__)
MAX_ATTEMPTS = 20


@dataclass
class RlixInitInfo(WeightTransferInitInfo):
    shm_dir: str | None = None
    keys_dir: str | None = None  # this shard's key pair, for owners on other nodes (tcp)
    key_name: str = ""


@dataclass
class RlixUpdateInfo(WeightTransferUpdateInfo):
    pipeline: str
    owner: str
    version: int
    segment: str
    generation: int
    fingerprint: str
    total_bytes: int
    host: str
    server: str = ""
    server_key: str = ""


class _StagingSink:
    """Private copies of a version's tensors (the slot may be rewritten under us)."""

    def __init__(self) -> None:
        self.named: list[tuple[str, torch.Tensor]] = []

    def start(self, version: int, layout: Layout) -> None:
        self.named = []

    def load(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.named.extend((name, t.clone()) for name, t in named)

    def finish(self, version: int) -> None:
        pass

    def abort(self) -> None:
        self.named = []


def stage_version(
    ref: CacheRef,
    layout: Layout | None,
    *,
    keys: ClientKeys | None = None,
    shm_dir: Path = SHM_DIR,
) -> tuple[CacheRef, Layout, list[tuple[str, torch.Tensor]]]:
    """A consistent private copy of the version ``ref`` names: shared memory on the
    owner's node, else tcp. If the owner overwrote the slot meanwhile, the copy is
    retried from the newer version the slot holds (the returned ref names the version
    copied). Also stages LoRA adapters (:mod:`rlix_async.shards.vllm_lora`)."""
    for _ in range(MAX_ATTEMPTS):
        staged = _StagingSink()
        try:
            layout = pull_blocking(ref, staged, layout, keys=keys, shm_dir=shm_dir)
        except SlotOverwritten as exc:
            logger.warning("%s; copying what the slot holds now", exc)
            time.sleep(0.01)
            ref = current_slot_ref(ref, shm_dir) or ref
            continue
        return ref, layout, staged.named
    raise SyncError(f"no consistent version of {ref.pipeline} after {MAX_ATTEMPTS} tries")


class RlixShmTransferEngine(WeightTransferEngine[RlixInitInfo, RlixUpdateInfo]):
    init_info_cls = RlixInitInfo
    update_info_cls = RlixUpdateInfo
    supports_draft_weight_update = False

    shm_dir = SHM_DIR
    layout: Layout | None = None  # read from shared memory once per model layout
    keys: ClientKeys | None = None

    def init_transfer_engine(self, init_info: RlixInitInfo) -> None:
        if init_info.shm_dir:
            self.shm_dir = Path(init_info.shm_dir)
        if init_info.keys_dir:
            self.keys = ClientKeys.load(init_info.keys_dir, init_info.key_name or "client")

    reloading = False  # the layerwise reload runs only once a version is staged

    def start_weight_update(self) -> None:
        # The reload itself starts in receive_weights, after the copy succeeded: a
        # sync that fails before (cache gone, owner unreachable) leaves the model
        # untouched and serving its previous weights, not half-reloaded.
        self.reloading = False

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self.reloading:
            finalize_layerwise_reload(self.model, self.model_config)
            self.reloading = False

    def receive_weights(self, update_info: RlixUpdateInfo) -> None:
        """Stage a consistent copy of the version, then load every tensor exactly once.

        vLLM's layerwise reload takes each weight once per session (a layer is
        finalized when its last weight arrives), so a torn read must never
        reach the model: the version is first copied out of the owner's slot
        (the seqlock proves the copy consistent) and, if the owner overwrote
        the slot meanwhile, the copy is retried from the newer version the
        slot holds. Costs one transient host copy of the weights.
        """
        ref = msgspec.convert(update_info.__dict__, CacheRef)
        _, self.layout, named = stage_version(
            ref, self.layout, keys=self.keys, shm_dir=self.shm_dir
        )
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self.reloading = True
        self.model.load_weights(self._with_tied_head(named))  # type: ignore[operator]

    def _with_tied_head(
        self, named: list[tuple[str, torch.Tensor]]
    ) -> list[tuple[str, torch.Tensor]]:
        """The embedding again as ``lm_head.weight`` when the model ties them: trainers
        leave the tied head out of the cache (it would move the largest matrix twice),
        but vLLM's layerwise reload counts the head as a layer of its own, and one that
        receives nothing keeps its old tensor (the output layer would stay stale)."""
        names = {name for name, _ in named}
        text_config = getattr(self.model_config, "hf_text_config", None)
        head = getattr(self.model, "lm_head", None)
        if (
            not getattr(text_config, "tie_word_embeddings", False)
            or "lm_head.weight" in names
            or not isinstance(head, torch.nn.Module)  # e.g. Gemma: logits from the embedding
        ):
            return named
        embed = next((t for name, t in named if name == "model.embed_tokens.weight"), None)
        if embed is None:  # a tied model whose embedding has another name: never stale silently
            raise SyncError(
                "the model ties lm_head to its embedding, and the update holds neither "
                "lm_head.weight nor model.embed_tokens.weight"
            )
        return [*named, ("lm_head.weight", embed)]

    def shutdown(self) -> None:
        forget_mappings()
