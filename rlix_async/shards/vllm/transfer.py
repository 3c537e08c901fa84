"""Our weight-transfer backend for vLLM (``WeightTransferConfig(backend="rlix_shm")``).

It runs inside vLLM's worker process (each tensor-parallel rank its own). The
update info is a :class:`~rlix_async.protocols.cache_ref.CacheRef`, and a version reaches
the model one of two ways:

- **On the owner's node** the worker maps the owner's shared-memory slot once
  (page-locked where the worker uses CUDA, so device copies read it by DMA) and
  holds it with a reader's lease for the whole load (``weights/shm.py``): the owner
  never rewrites a slot under it, so the model's loader reads the slot's bytes
  directly, with no private copy of the version. Each rank's loader narrows every
  tensor to its own shard before copying, so it touches only those bytes.
- **From another node** the node's cache receives it (``weights/node_cache.py``), or
  where no receiver runs, the version is received into private memory first: a
  stream can break halfway, and a model must never be left with half a version.
  Either way each rank only fetches in ``receive_weights`` and loads in
  ``finish_weight_update`` (from the node's slot in place, or its private copy).

Both are engine-neutral: ``weights/staging.py``'s ``fetch_version`` asks
``weights/transports/`` which transport reaches the version and takes the leased or
the staged path for it. A staged copy is loaded at ``finish_weight_update``, after
every tensor-parallel rank fetched the same version (``VllmEngine.load_version``): one
rank's failed transfer leaves all of them on the old weights. What is vLLM's is here:
the transfer engine, the reload, the tied head.

Loading is vLLM's layerwise reload (``initialize_layerwise_reload``, the model's
``load_weights``, ``finalize_layerwise_reload``), which rebuilds each layer and
re-runs what vLLM does to weights after loading (repacking on CPU, quantisation;
the CPU experts' prepack of a mixture-of-experts layer, which vLLM 0.32 skips on
updates, is run again here: ``vllm_api.prepack_cpu_experts``).
Where every module vLLM built uses its weights as loaded (CUDA, an allowlist of
layers: :func:`vllm_api.reload_needed`) it is skipped, and ``load_weights`` copies each tensor straight into the serving
parameters. A lease that expired under a hung load (the owner rewrote the slot)
is caught by the seqlock after the load, and the load is redone from the version
the slot holds then; the worker's engine is paused throughout, so nothing is
served from the mixture in between.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from rlix_async.protocols.cache_ref import CacheRef, Layout
from rlix_async.protocols.sinks import SyncError
from rlix_async.security import ClientKeys
from rlix_async.shards.vllm import api as vllm_api
from rlix_async.weights.shm import SHM_DIR, forget_mappings
from rlix_async.weights.staging import Fetched, Named, fetch_version, load_fetched

logger = logging.getLogger(__name__)
PARTLY_LOADED = -1  # a model_version no cached version has: a load failed part way


@dataclass
class RlixInitInfo(vllm_api.WeightTransferInitInfo):  # type: ignore[misc]
    shm_dir: str | None = None
    keys_dir: str | None = None  # this shard's key pair, for owners on other nodes (tcp)
    key_name: str = ""


# Every CacheRef field, as vLLM builds this from the update's dict (keyword arguments: a
# field missing here fails every sync; tests/unit/test_vllm_api.py compares the two).
@dataclass
class RlixUpdateInfo(vllm_api.WeightTransferUpdateInfo):  # type: ignore[misc]
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
    transport: str = "sealed"
    incarnation: str = ""
    manifest_key: str = ""


class RlixShmTransferEngine(vllm_api.WeightTransferEngine):  # type: ignore[misc]
    init_info_cls = RlixInitInfo
    update_info_cls = RlixUpdateInfo
    supports_draft_weight_update = False

    shm_dir = SHM_DIR
    layout: Layout | None = None  # read from shared memory once per model layout
    keys: ClientKeys | None = None
    # why the layerwise reload is needed here (None: tensors are copied in directly)
    reload_reason: str | None = "not initialised"
    loads = 0  # versions loaded by this worker, and how (for tests and benchmarks)
    last_load: dict[str, object] = {}
    # the version this rank's model holds (None: as built; PARTLY_LOADED: a load failed)
    model_version: int | None = None
    error: str | None = None  # why this session's fetch or load failed (None: it did not)
    # this session's fetched version (not yet loaded where ``staged`` is set)
    pending: Fetched | None = None
    pending_started = 0.0

    def init_transfer_engine(self, init_info: RlixInitInfo) -> None:
        if init_info.shm_dir:
            self.shm_dir = Path(init_info.shm_dir)
        if init_info.keys_dir:
            self.keys = ClientKeys.load(init_info.keys_dir, init_info.key_name or "client")
        self.reload_reason = vllm_api.reload_needed(self.model, vllm_api.current_platform.is_cuda())

    def start_weight_update(self) -> None:
        # Nothing to prepare: the reload runs whole inside the load, once the version
        # is here, so a sync that fails before (cache gone, owner unreachable, a
        # broken stream) leaves the model untouched and serving its previous weights.
        self.pending, self.error = None, None

    def receive_weights(self, update_info: RlixUpdateInfo) -> None:
        """Fetch the version (``update_weights``); on the owner's node the slot is read
        in place now, elsewhere the private copy waits for ``finish_weight_update``, so
        that a tensor-parallel shard loads only once every rank has the version (the
        engine checks they hold the same one in between: ``VllmEngine.load_version``).

        A failure is kept in ``error``, not raised: vLLM's executor stops reading its
        workers' replies at the first rank that raised, and the replies of the ranks
        after it would then answer the engine's next calls (every later call one
        reply behind). The engine reads ``error`` from each rank instead."""
        t0 = time.perf_counter()
        try:
            self.pending = fetch_version(
                msgspec.convert(update_info.__dict__, CacheRef),
                self.layout,
                self._load,
                keys=self.keys,
                shm_dir=self.shm_dir,
            )
        except Exception as exc:
            logger.error("weight update failed: %s", exc)
            self.error = f"{type(exc).__name__}: {exc}"
            return
        self.layout = self.pending.layout
        self.pending_started = t0
        if self.pending.loaded:  # read in place on the owner's node: loaded already
            self._loaded(self.pending, t0)

    def finish_weight_update(self) -> None:
        """Load the private copy ``receive_weights`` fetched (nothing if it read the
        slot in place, or if the session was abandoned). A failed load is kept in
        ``error`` (see ``receive_weights``), and the model's version is then unknown."""
        pending, self.pending = self.pending, None
        if pending is None or pending.loaded:
            return
        try:
            pending = load_fetched(pending, self._load, self.shm_dir)
        except Exception as exc:
            logger.error("loading version %d failed: %s", pending.ref.version, exc)
            self.error = f"{type(exc).__name__}: {exc}"
            self.model_version = PARTLY_LOADED
            return
        self._loaded(pending, self.pending_started)

    def abandon(self) -> None:
        """Drop a fetched copy that will not be loaded (another rank failed its fetch)."""
        self.pending = None

    def _loaded(self, fetched: Fetched, t0: float) -> None:
        self.loads += 1
        self.model_version = fetched.ref.version
        self.last_load = {
            "version": fetched.ref.version,
            "seconds": time.perf_counter() - t0,
            "path": "layerwise" if self.reload_reason else "direct",
            "reload_reason": self.reload_reason,
            # a private copy: only what came over tcp
            "staged_bytes": fetched.staged_bytes,
        }

    def _load(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Every tensor into the model exactly once: a direct copy where vLLM allows
        it, else inside a layerwise reload, finalised even when the load fails (a
        layer left half-reloaded would stay on the meta device and kill the engine)."""
        named = self._with_tied_head(list(named))
        if self.reload_reason is None:
            self.model.load_weights(named)
            return
        vllm_api.initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(named)
        finally:
            vllm_api.finalize_layerwise_reload(self.model, self.model_config)
        vllm_api.prepack_cpu_experts(self.model)  # vLLM 0.32 skips it on updates

    def _with_tied_head(self, named: Named) -> Named:
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
