"""The torch trainer backend: a HF ``LlamaForCausalLM`` under torchrun, DDP over gloo/NCCL.

Time-sharing cycle: the collective group lives only while the
trainer holds its devices. ``reload`` and ``init_group`` before a step (a fresh
group on a prefix of the persistent torchrun store), ``train_step``, then
``destroy_group``, ``offload`` (the whole training state into page-locked host
buffers, the device left empty) and ``weights_for_cache`` (the host copy the
rollout shards sync from) before the stage is released.

Devices: one per rank, ``cuda:{LOCAL_RANK}`` among those the process sees (the
launcher sets ``CUDA_VISIBLE_DEVICES`` to the pipeline's actor_train devices).
Precision: parameters in ``TrainConfig.dtype``; under ``bfloat16`` the optimizer
keeps float32 main weights and moments (``train/precision.py``), under
``bfloat16_pure`` nothing in float32; log-probs, importance ratios, advantages and
the loss always in float32.

The step itself is train/policy_update.py's (every backend shares it), run over
:class:`~rlix_async.train.data_parallel.DataParallel`.

LoRA (``lora``): the model is a peft model on the frozen base; the optimizer,
DDP's gradient reduction, checkpoints and the weight cache hold the adapter only, and
the KL reference is the base itself (the adapter switched off, no second copy). The
adapter and its optimizer state are float32 (train/lora.py says why).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from rlix_async.config import ModelConfig, TorchTrainConfig, resolve_dtype
from rlix_async.models.hf import load_hf_model
from rlix_async.protocols.batch import Group
from rlix_async.train import lora as lora_utils
from rlix_async.train.checkpoints import (
    read_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from rlix_async.train.data_parallel import DataParallel
from rlix_async.train.devices import RankPlace
from rlix_async.train.host_buffers import DeviceOffload, state_tensors
from rlix_async.train.policy_update import PolicyUpdate
from rlix_async.train.precision import (
    DTYPES,
    MainParamsAdamW,
    build_optimizer,
    cast_floats,
    cast_parameters,
    drop_main_params,
)

if TYPE_CHECKING:
    from rlix_async.config import PipelineConfig
    from rlix_async.config.lora import LoraConfig


class TorchTrainer:
    def __init__(
        self,
        cfg: TorchTrainConfig | None = None,
        model: ModelConfig | None = None,
        *,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
        start_offloaded: bool = False,
        temperature: float = 1.0,
        top_p: float = 1.0,
        lora: LoraConfig | None = None,
        total_steps: int | None = None,
    ) -> None:
        self.cfg = cfg or TorchTrainConfig()
        self.lora = lora
        self.model_cfg = model or ModelConfig()
        self.seed = seed
        self.place = RankPlace.of(rank, world)
        self.device = self.place.device
        self.dtype = DTYPES[resolve_dtype(self.cfg.dtype, self.device.type == "cuda")]
        # start_offloaded (the pipeline): built in host memory, onto the device at the
        # first reload(), i.e. once the coordinator has granted it
        self.model = self._build_model()
        if lora is not None:  # still in host memory: the adapter is built there
            self.model = lora_utils.lora_model(self.model, lora, seed)
        if not start_offloaded:
            self.model = self.model.to(self.device)
        self.optim = build_optimizer(list(lora_utils.trainable(self.model)), self.cfg)
        # the KL penalty's reference: the starting weights, frozen (a resume rebuilds it
        # from the same start, so checkpoints need not hold it). An adapter's start is
        # its base, which the model holds already: no copy (PolicyUpdate switches the
        # adapter off for it)
        self.reference: torch.nn.Module | None = None
        if self.cfg.loss.kl_coef > 0 and lora is None:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.parallel = DataParallel(
            self.device,
            rank,
            world,
            temperature=temperature,
            top_p=top_p,
            max_grad_norm=self.cfg.max_grad_norm,
        )
        self.update = PolicyUpdate(
            self.cfg,
            self.parallel,
            self.device,
            total_steps=total_steps or 0,
            adapter_reference=lora is not None,
        )
        self.step = 0
        self.step_times: dict[str, float] = {}  # the last train_step's, by part
        self._group_gen = 0
        self._memory = DeviceOffload(self.device)
        if start_offloaded and self.device.type == "cuda":  # built in host memory
            self._memory.moved = list(state_tensors(self.model, self.optim, self.reference))

    def _build_model(self) -> torch.nn.Module:
        if self.model_cfg.path:
            model = load_hf_model(self.model_cfg.path, self.dtype)
        else:
            from rlix_async.models.tiny import tiny_llama

            model = cast_parameters(tiny_llama(self.seed, **self.model_cfg.tiny), self.dtype)
        if self.cfg.recompute == "full":
            # each decoder layer's activations again in the backward pass; non-reentrant:
            # works under DDP and when the inputs need no grad (a LoRA adapter's base)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        return model

    @property
    def offloaded(self) -> bool:
        return bool(self._memory.moved)

    @property
    def has_reference(self) -> bool:
        return self.update.has_reference(self.reference)

    def _require_on_device(self, what: str) -> None:
        if self._memory.moved:
            raise RuntimeError(f"{what} on an offloaded trainer: call reload() first")

    # --- collective group lifecycle ----------------------------------------------------

    def init_group(self, store: dist.Store | None) -> None:
        """A fresh process group for this step (nothing without a store: running alone)."""
        if store is None:
            return
        self._require_on_device("init_group()")
        self._group_gen += 1
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: the pipeline trains in a worker thread
        dist.init_process_group(
            self.place.backend,
            store=dist.PrefixStore(f"rlix-pg-{self._group_gen}", store),
            rank=self.place.rank,
            world_size=self.place.world,
        )
        self.parallel.wrap(self.model)

    def destroy_group(self) -> None:
        self.parallel.unwrap()
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- device memory -----------------------------------------------------------------

    def offload(self) -> None:
        """Free the device for rollout: the training state into page-locked host buffers
        (``host_buffers.DeviceOffload``). On CPU: nothing to do."""
        if self.device.type != "cuda" or self._memory.moved:
            return
        if self.parallel.ddp is not None:
            raise RuntimeError("offload() while the process group is up: destroy_group() first")
        self._memory.offload(self.model, self.optim, self.reference)

    def reload(self) -> None:
        """Back onto the device: what offload() moved (a checkpoint loaded meanwhile included)."""
        if self._memory.moved:
            self._memory.reload(self.model, self.optim, self.reference)

    # --- one GRPO step -------------------------------------------------------------------

    def logp(
        self, model: torch.nn.Module, ids: torch.Tensor, width: int | None = None
    ) -> torch.Tensor:
        """log p of ``ids``' last ``width`` tokens (all but the first when None) under
        ``model``'s sampling distribution."""
        width = ids.shape[1] - 1 if width is None else width
        logits = self.parallel.logits(model, ids, width + 1)
        return self.parallel.token_logp(logits, ids, width, False)[0]

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        """One training step: ``cfg.minibatches`` optimizer updates on ``groups``; its
        figures. Where its time went (packing, the pi_old pass, the updates) is in
        ``step_times``."""
        self._require_on_device("train_step()")
        stats = self.update.run(self.model, self.optim, self.reference, groups, self.step)
        self.step += 1
        self.step_times = dict(self.update.step_times)
        return stats

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        """HF names, as vLLM's ``load_weights`` expects them, in the trainer's dtype.

        After ``offload`` these are views of the page-locked host buffers (no copy).
        A tied ``lm_head.weight`` is left out: it is the embedding (vLLM's loader skips
        it too), and sending it would move the largest matrix twice.
        With LoRA: the adapter only, in the shards' format (train/lora.py).
        """
        if self.lora is not None:
            return lora_utils.adapter_for_cache(self.model, self.dtype)
        state = self.model.state_dict()
        if getattr(self.model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        return cast_floats(state, self.dtype)

    # --- checkpoint ------------------------------------------------------------------------

    def save(self, path: Path, extra: dict[str, Any]) -> Path:
        """Model, optimizer, step and RNG, with ``extra``: plain values only (lists,
        dicts, numbers, strings, tensors), what ``load`` accepts; returns the path
        written. With LoRA, "model" is the adapter alone and "lora" says what it was
        trained on (base directory, config, dtype): the frozen base is never written."""
        if self.lora is not None:
            model_state = lora_utils.adapter_state(self.model)
            extra = {
                **extra,
                "lora": lora_utils.record(self.lora, self.model_cfg.path, self.dtype),
            }
        else:
            model_state = self.model.state_dict()
        state = {
            "model": model_state,
            "optim": self.optim.state_dict(),
            "step": self.step,
            "rng": rng_state(self.device),
        }
        return write_checkpoint(path, {**state, **extra})

    def load(self, path: Path) -> dict[str, Any]:
        """The checkpoint at ``path``, installed; its other entries (buffer, collector
        state) returned (read with ``weights_only``: train/checkpoints.py)."""
        ckpt = read_checkpoint(path)
        if self.lora is not None or "lora" in ckpt:  # either: a mismatch is refused there
            lora_utils.load_checkpoint_adapter(self.model, self.lora, ckpt, path)
        else:
            self.model.load_state_dict(ckpt["model"])
        self.optim.load_state_dict(ckpt["optim"])
        if not isinstance(self.optim, MainParamsAdamW):  # main weights of another run
            drop_main_params(self.optim)
        self.step = int(ckpt["step"])
        set_rng_state(ckpt["rng"], self.device)
        return ckpt


class TorchBackend:
    """``train.backend: torch`` (train/backends.py)."""

    def build(
        self, cfg: PipelineConfig, rank: int, world: int, store: dist.Store | None
    ) -> TorchTrainer:
        assert isinstance(cfg.train, TorchTrainConfig)  # the registry's choice
        # in host memory until the first grant: the devices are not the pipeline's yet
        return TorchTrainer(
            cfg.train,
            cfg.model,
            seed=cfg.seed,
            rank=rank,
            world=world,
            start_offloaded=True,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            lora=cfg.lora,
            total_steps=cfg.steps,
        )

    def check(self, cfg: PipelineConfig) -> None:
        pass  # any model transformers loads as a causal LM

    def hf_state(self, state: dict[str, Any], base: Path) -> dict[str, Any]:
        return state  # saved in the HF model's own names


BACKEND = TorchBackend()
