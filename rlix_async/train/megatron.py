"""The Megatron-core trainer backend: a Llama-shaped ``GPTModel``, exported under HF names.

Same interface and time-sharing cycle as :class:`TorchTrainer` (per-step
process groups, offload, cache export), with Megatron's parallel state built
and destroyed together with the group. ``model.path`` names an HF Llama-family
directory: its weights come in through ``hf_to_megatron`` (grouped-query
attention, tied embeddings, its RoPE base and norm epsilon); other families are
refused by :func:`llama_shape` with a one-line reason. Weights leave in HF
``LlamaForCausalLM`` names (``megatron_to_hf``) because that is what vLLM's
loader takes; both conversions are exact (tests compare logits).

Tensor parallel (``tp``, the actor_train cluster's): ``tp`` consecutive ranks hold one
replica, split as ``train/tensor_parallel.py`` says; replicas are data parallel (torch
DDP over the data-parallel group). The logits are gathered over the tensor-parallel
group (Megatron's ``parallel_output=False``) so every loss, entropy and log-prob is
computed as at tp=1; the gradient norm sums the split weights' squares over the group.
Ranks build the model together (the group is up while the trainer is constructed),
and after every step the first replica's ranks gather the full weights onto rank 0,
which builds the weight cache from them; at checkpoint steps the optimizer state too,
so a checkpoint is the tp=1 state at any layout and resumes at any other. On CPU it
needs ``megatron_cpu_compat`` (megatron-core 0.16.1 assumes CUDA in two places).
Its CUDA RNG tracker is seeded (``model_parallel_cuda_manual_seed``) with the parallel
state; on CPU the compat module keeps that tracker's states on the CPU generator.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlix_async.config import ModelConfig, TrainConfig
from rlix_async.models.hf import load_hf_model
from rlix_async.train.buffer import Group
from rlix_async.train.megatron_hf import (
    MegatronModelError,
    hf_to_megatron,
    llama_shape,
    megatron_to_hf,
    read_hf_part,
)
from rlix_async.train.precision import cast_floats, cast_parameters
from rlix_async.train.tensor_parallel import (
    check_shape,
    merge_tensor,
    pad_vocab_rows,
    padded_vocab,
    shard,
    shard_optimizer,
    split_dim,
)
from rlix_async.train.trainer import TorchTrainer


def _tiny_shape(model: ModelConfig) -> dict[str, Any]:
    m = model.tiny
    heads = m["hidden"] // 64
    return {
        **m,
        "heads": heads,
        "groups": heads,
        "head_dim": 64,
        "ffn": 2 * m["hidden"],
        "eps": 1e-6,
        "rope_base": 10000.0,
        "tied": False,
        "max_len": 4096,
    }


def _seed_rng_tracker(seed: int) -> None:
    """Seed Megatron's model-parallel RNG tracker once per process: attention forks it
    around dropout, and an unseeded tracker raises there at the first forward. Kept
    across the per-step rebuilds of the parallel state (which leave it alone), so
    random streams continue from step to step instead of restarting."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    if not get_cuda_rng_tracker().is_initialized():
        model_parallel_cuda_manual_seed(seed)


class MegatronTrainer(TorchTrainer):
    _shape: dict[str, Any]  # the GPTModel's shape, set by _build_model

    def __init__(
        self,
        cfg: TrainConfig | None = None,
        model: ModelConfig | None = None,
        *,
        tp: int = 1,
        store: dist.Store | None = None,
        checkpoint_due: Callable[[int], bool] | None = None,
        **kw: Any,
    ) -> None:
        """``tp`` consecutive ranks per replica; with ``tp`` > 1 every rank constructs
        its trainer at the same time, meeting on ``store``. ``checkpoint_due(step)``:
        whether the step just trained is checkpointed (the optimizer state is gathered
        for rank 0 then)."""
        world = int(kw.get("world", 1))
        if tp > 1 and (store is None or world % tp):
            raise ValueError(f"tensor parallel {tp} needs a store and a multiple of {tp} ranks")
        self.tp = tp
        self._store = store
        self.checkpoint_due = checkpoint_due or (lambda step: False)
        self._full: dict[str, torch.Tensor] | None = None  # rank 0, tp > 1: the whole model
        self._full_optim: dict[str, Any] | None = None  # and at checkpoint steps its optimizer
        try:
            super().__init__(cfg, model, **kw)
            self.dp_rank, self.dp_world = self.rank // tp, self.world // tp
            if tp > 1:
                self._full = self._gather_model()
        finally:
            if tp > 1:
                self.destroy_group()

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    def _dp_group(self) -> dist.ProcessGroup | None:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group() if self.tp > 1 else None

    def _parallel_state(self, store: dist.Store | None, backend: str | None = None) -> None:
        """Megatron's parallel state over a fresh group on ``store`` (None: a private
        one-rank group); ``backend`` by default NCCL on CUDA, gloo on CPU."""
        from megatron.core import parallel_state

        if not dist.is_initialized():
            self._group_gen += 1
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # per thread: the pipeline trains in one
            dist.init_process_group(
                backend or ("nccl" if self.device.type == "cuda" else "gloo"),
                store=dist.PrefixStore(f"rlix-mg-{self._group_gen}", store or dist.HashStore()),
                rank=self.rank if store is not None else 0,
                world_size=self.world if store is not None else 1,
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(self.tp if store is not None else 1, 1)
        _seed_rng_tracker(self.seed)

    def _build_model(self) -> torch.nn.Module:
        from rlix_async.train import megatron_cpu_compat

        megatron_cpu_compat.apply()  # before Megatron is imported or used (CPU only)
        path = self.model_cfg.path
        self._shape = llama_shape(path) if path else _tiny_shape(self.model_cfg)
        check_shape(self._shape["heads"], self._shape["groups"], self.tp)
        model = self._gpt_model()
        if path:
            self._load_hf(model, path)
        return model

    def _gpt_model(self) -> torch.nn.Module:
        """A GPTModel of ``self._shape``, seeded initial weights, in the trainer's dtype."""
        import torch.nn.functional as F
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = self._shape
        # building the model needs Megatron's parallel state: a private one-rank group,
        # or with tensor parallel the real one, up until the constructor's end
        # (gloo: the model is built, loaded and gathered in host memory)
        self._parallel_state(self._store if self.tp > 1 else None, "gloo")
        torch.manual_seed(self.seed)
        tc = TransformerConfig(
            num_layers=s["layers"],
            hidden_size=s["hidden"],
            num_attention_heads=s["heads"],
            num_query_groups=s["groups"],
            kv_channels=s["head_dim"],
            ffn_hidden_size=s["ffn"],
            normalization="RMSNorm",
            layernorm_epsilon=s["eps"],
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            use_cpu_initialization=True,
            params_dtype=self.dtype,
            bf16=self.dtype == torch.bfloat16,  # attention softmax in float32 on bf16 inputs
            attention_dropout=0.0,
            hidden_dropout=0.0,
            bias_activation_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            **_recompute(self.cfg.recompute),
        )
        model = GPTModel(
            config=tc,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=padded_vocab(s["vocab_size"], self.tp),
            max_sequence_length=s["max_len"],
            position_embedding_type="rope",
            rotary_base=s["rope_base"],
            share_embeddings_and_output_weights=s["tied"],
            parallel_output=False,  # every rank gets the whole vocabulary's logits
        )
        if self.tp == 1:
            self.destroy_group()  # the time-sharing cycle creates groups per step
        return cast_parameters(model, self.dtype)  # the local spec's norms ignore params_dtype

    def _load_hf(self, model: torch.nn.Module, path: str) -> None:
        """The directory's weights into ``model``, every parameter accounted for. Under
        tensor parallel each rank reads only its own slices of a safetensors
        directory (its memory holds its part of the model, not all of it)."""
        s = self._shape
        if self.tp > 1 and (part := read_hf_part(path, s, self.tp_rank, self.tp)) is not None:
            local = hf_to_megatron(
                part, s["heads"] // self.tp, s["groups"] // self.tp, s["head_dim"], tied=s["tied"]
            )
            pad_vocab_rows(local, s["vocab_size"], self.tp)
            self._install(model, local, path, whole=False)
            return
        hf = load_hf_model(path, torch.float32)
        weights = hf_to_megatron(
            hf.state_dict(), s["heads"], s["groups"], s["head_dim"], tied=s["tied"]
        )
        del hf
        self._install(model, weights, path)

    def _install(
        self,
        model: torch.nn.Module,
        state: Mapping[str, object],
        source: object,
        whole: bool = True,
    ) -> None:
        """The full (tp=1) ``state``, this rank's part of it (``whole=False``: ``state``
        is that part already), into ``model``; every parameter accounted for."""
        mine = shard(state, self.tp_rank, self.tp) if whole else dict(state)
        mine = {k: v for k, v in mine.items() if v is not None}
        missing, unexpected = model.load_state_dict(mine, strict=False)
        missing = [k for k in missing if "_extra_state" not in k]  # TE/fp8 metadata
        if missing or unexpected:
            raise MegatronModelError(
                f"{source}: weights do not fit the Megatron model (missing {missing[:3]}, "
                f"unexpected {unexpected[:3]})"
            )

    def _frozen_copy(self) -> torch.nn.Module:
        # deepcopy cannot copy the process groups Megatron's modules hold: build another
        # (not from the checkpoint again: the policy's weights are the ones to copy)
        reference = self._gpt_model()
        reference.load_state_dict(self.model.state_dict())
        where = next(self.model.parameters()).device
        return reference.to(where).eval().requires_grad_(False)

    def init_group(self, store: dist.Store | None) -> None:
        self._require_on_device("init_group()")
        self._parallel_state(store if self.world > 1 else None)
        if self.dp_world > 1:
            self._wrap_ddp()

    def destroy_group(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        super().destroy_group()  # DDP, then the default group

    def forward_logits(
        self, model: torch.nn.Module, ids: torch.Tensor, keep: int | None = None
    ) -> torch.Tensor:
        """Megatron's GPTModel computes every position's logits; the last ``keep`` are
        returned."""
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device).unsqueeze(0).expand_as(ids)
        causal = torch.triu(torch.ones(n, n, device=ids.device), diagonal=1).bool()[None, None]
        logits = model(ids, pos, attention_mask=causal)[..., : self._shape["vocab_size"]]
        return logits if keep is None else logits[:, -keep:]

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        if not dist.is_initialized():  # running alone: a private one-rank group
            if self.tp > 1:
                raise RuntimeError("a tensor-parallel step needs init_group(store) first")
            self._parallel_state(None)
            try:
                return super().train_step(groups)
            finally:
                self.destroy_group()
        stats = super().train_step(groups)
        if self.tp > 1:  # while the group is up: the cache and checkpoint need it whole
            t0 = time.perf_counter()
            self._full = self._gather_model()
            self._full_optim = self._gather_optimizer() if self.checkpoint_due(self.step) else None
            self.step_times["time_gather_s"] = round(time.perf_counter() - t0, 4)
        return stats

    def _clip_grads(self, params: list[torch.nn.Parameter]) -> torch.Tensor:
        if self.tp == 1:
            return super()._clip_grads(params)
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        # each split weight's squares once per rank, each whole one (the same on every
        # rank) only on tensor-parallel rank 0: summed over the group, every weight once
        grads = [(p, p.grad) for p in params if p.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for p, g in grads:
            if param_is_not_tensor_parallel_duplicate(p):
                squares += g.float().pow(2).sum()
        dist.all_reduce(squares, group=parallel_state.get_tensor_model_parallel_group())
        norm = squares.sqrt()
        if torch.isfinite(norm):
            coef = (self.cfg.max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            for _, g in grads:
                g.mul_(coef.to(g.dtype))
        return norm

    def _gather(self, name: str, local: torch.Tensor) -> torch.Tensor | None:
        """The full tensor ``name`` on rank 0 (None elsewhere) from the parts of this
        replica's tensor-parallel group (every rank of the first replica takes part)."""
        from megatron.core import parallel_state

        if split_dim(name) is None:
            return local.detach().to("cpu", copy=True) if self.rank == 0 else None
        group = parallel_state.get_tensor_model_parallel_group()
        local = local.detach().contiguous()
        if dist.get_backend(group) == "gloo":  # the constructor's group: host tensors
            local = local.cpu()
        parts = [torch.empty_like(local) for _ in range(self.tp)]
        dist.all_gather(parts, local, group=group)
        if self.rank != 0:
            return None
        # the merge is a new tensor: to the host once (no second copy when already there)
        return merge_tensor(name, parts, self._shape["vocab_size"]).to("cpu")

    def _gather_model(self) -> dict[str, torch.Tensor] | None:
        if self.dp_rank != 0:  # the other replicas hold the same weights
            return None
        out = {}
        for name, v in self.model.state_dict().items():
            if isinstance(v, torch.Tensor):
                full = self._gather(name, v)
                if full is not None:
                    out[name] = full
        return out if self.rank == 0 else None

    def _param_names(self) -> list[str]:
        """The trainable parameters' names in the optimizer's order."""
        return [n for n, p in self.model.named_parameters() if p.requires_grad]

    def _gather_optimizer(self) -> dict[str, Any] | None:
        if self.dp_rank != 0:
            return None
        local = self.optim.state_dict()
        names = self._param_names()
        state: dict[int, dict[str, Any]] = {}
        for i, s in local["state"].items():
            state[i] = {}
            for k, v in s.items():
                full = self._gather(names[i], v) if isinstance(v, torch.Tensor) and v.dim() else v
                state[i][k] = full
        return {"state": state, "param_groups": local["param_groups"]} if self.rank == 0 else None

    def _model_state(self) -> dict[str, Any]:
        """The whole (tp=1) model in Megatron's names: this rank's own at tp=1, else the
        one gathered onto rank 0 at every step (checkpoints and the cache read it)."""
        if self.tp == 1:
            return self.model.state_dict()
        if self._full is None:
            raise RuntimeError("only rank 0 holds the whole model (gathered at every step)")
        return self._full

    def _optim_state(self) -> dict[str, Any]:
        if self.tp == 1:
            return super()._optim_state()
        if self._full_optim is None:
            raise RuntimeError(
                f"the optimizer state of step {self.step} was not gathered: its checkpoint "
                "must be due (checkpoint_due) when it trains"
            )
        return self._full_optim

    def save(self, path: Path, extra: dict[str, Any]) -> None:
        try:
            super().save(path, extra)
        finally:
            self._full_optim = None  # whole on rank 0 only until it is written

    def _load_model(self, path: Path, ckpt: dict[str, Any]) -> None:
        """A checkpoint holds the whole (tp=1) model whatever its layout: this rank's
        part of it, and on rank 0 the whole for the cache."""
        rows = ckpt["model"].get("embedding.word_embeddings.weight")
        if isinstance(rows, torch.Tensor) and rows.shape[0] != self._shape["vocab_size"]:
            raise MegatronModelError(
                f"{path}: its vocabulary has {rows.shape[0]} rows, the model "
                f"{self._shape['vocab_size']}"
            )
        self._install(self.model, ckpt["model"], path)
        if self.tp > 1 and self.rank == 0:
            self._full = {k: v for k, v in ckpt["model"].items() if isinstance(v, torch.Tensor)}

    def _load_optim(self, state: dict[str, Any]) -> None:
        super()._load_optim(shard_optimizer(state, self._param_names(), self.tp_rank, self.tp))

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        s = self._shape
        hf = megatron_to_hf(self._model_state(), s["heads"], s["groups"], s["head_dim"])
        return cast_floats(hf, self.dtype)


def _recompute(kind: str) -> dict[str, Any]:
    """TransformerConfig's activation recomputation for ``train.recompute``."""
    if kind == "full":  # every layer's activations, one layer per checkpoint
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}  # fmt: skip
    if kind == "selective":  # core attention only (Megatron's default module list)
        return {"recompute_granularity": "selective"}
    return {}
