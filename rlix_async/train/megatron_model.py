"""The GPTModel the Megatron backend trains: its shape, its TransformerConfig, how one
rank's part of it (a pipeline stage, split over tensor-parallel ranks) is built and
run, and how its modules are pointed at a new set of process groups.

Pure construction: the trainer (``train/megatron.py``) owns the parallel state these
need and the time-sharing cycle around them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from rlix_async.config import ModelConfig
from rlix_async.train import megatron_cpu_compat
from rlix_async.train.megatron_moe import bind_missing_te_gemm, moe_config
from rlix_async.train.precision import cast_parameters
from rlix_async.train.tensor_parallel import padded_vocab


def tiny_shape(model: ModelConfig) -> dict[str, Any]:
    """The GPTModel shape of the tiny random Llama (``model.path`` unset): heads of 64."""
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


def seed_rng_tracker(seed: int) -> None:
    """Seed Megatron's model-parallel RNG tracker once per process: attention forks it
    around dropout, and an unseeded tracker raises there at the first forward. Kept
    across the per-step rebuilds of the parallel state (which leave it alone), so
    random streams continue from step to step instead of restarting."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed

    if not get_cuda_rng_tracker().is_initialized():
        model_parallel_cuda_manual_seed(seed)


def gpt_model(
    shape: dict[str, Any],
    dtype: torch.dtype,
    recompute: str,
    tp: int,
    pp: int,
    stage: int,
    ep: int = 1,
    *,
    routing_replay: bool = False,
) -> torch.nn.Module:
    """Stage ``stage`` of ``pp`` of a GPTModel of ``shape`` (this rank's tensor- and
    expert-parallel part, under Megatron's current parallel state), in ``dtype``, in
    host memory."""
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    s = shape
    moe = s.get("moe")
    if moe is not None:
        bind_missing_te_gemm()
        megatron_cpu_compat.alltoall_on_host()
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
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,  # attention softmax in float32 on bf16 inputs
        attention_dropout=0.0,
        hidden_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        calculate_per_token_loss=True,  # each piece's loss is weighed already
        qk_layernorm=bool(s.get("qk_norm")),
        **recompute_config(recompute),
        **(pipeline_config(pp, dtype) | (moe_config(moe, ep, pp) if moe is not None else {})),
        # each router gets a RouterReplay hook (train/routing_replay.py drives it)
        moe_enable_routing_replay=routing_replay,
    )
    if moe is not None:  # the local spec makes every layer MoE: the block spec reads which
        spec: Any = get_gpt_decoder_block_spec(
            tc, use_transformer_engine=False, normalization="RMSNorm"
        )
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=tc.qk_layernorm)
    model = GPTModel(
        config=tc,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab(s["vocab_size"], tp),
        max_sequence_length=s["max_len"],
        position_embedding_type="rope",
        rotary_base=s["rope_base"],
        share_embeddings_and_output_weights=s["tied"],
        parallel_output=False,  # the whole vocabulary's logits unless run_model says
        pre_process=stage == 0,
        post_process=stage == pp - 1,
    )
    # with tied embeddings on two stages Megatron sums the copies .cuda(): the model
    # is built in host memory, onto the device at the trainer's first reload
    for p in model.parameters():
        if p.device.type != "cpu":
            p.data = p.data.cpu()
    return cast_parameters(model, dtype)  # the local spec's norms ignore params_dtype


def pipeline_config(pp: int, dtype: torch.dtype) -> dict[str, Any]:
    """TransformerConfig's pipeline settings: stages exchange activations of each
    piece's own shape (pieces differ in rows and width)."""
    if pp == 1:
        return {}
    return {
        "pipeline_model_parallel_size": pp,
        "pipeline_dtype": dtype,
        "variable_seq_lengths": True,
        # Megatron refuses variable lengths with its default dispatcher even without
        # experts (an MoE model's config sets its own: moe_config)
        "moe_token_dispatcher_type": "alltoall",
    }


def recompute_config(kind: str) -> dict[str, Any]:
    """TransformerConfig's activation recomputation for ``train.recompute``."""
    if kind == "full":  # every layer's activations, one layer per checkpoint
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": 1}  # fmt: skip
    if kind == "selective":  # core attention only (Megatron's default module list)
        return {"recompute_granularity": "selective"}
    return {}


def run_model(model: torch.nn.Module, ids: torch.Tensor, gather: bool = True) -> torch.Tensor:
    """A GPTModel (or one stage of it) on ``ids`` with explicit positions and causal
    mask (its default mask is built on "cuda"). ``gather``: the last stage's logits
    over the whole (padded) vocabulary on every tensor-parallel rank, else each rank's
    own slice of it (train/vocab_parallel.py)."""
    n = ids.shape[1]
    pos = torch.arange(n, device=ids.device).unsqueeze(0).expand_as(ids)
    causal = torch.triu(torch.ones(n, n, device=ids.device), diagonal=1).bool()[None, None]
    return model(ids, pos, attention_mask=causal, runtime_gather_output=gather)


# Group attributes whose name is not the ProcessGroupCollection field they hold: an
# MoE layer's attention tensor-parallel group, and inside an expert module (and in an
# MoE layer's token dispatcher, which is no nn.Module) the expert groups.
_RENAMED = {"attn_tp_group": "tp"}
_IN_EXPERTS = {"tp_group": "expt_tp", "dp_group": "expt_dp"}


def rebind_groups(models: list[torch.nn.Module]) -> None:
    """Point every module of ``models`` at the process groups Megatron's parallel state
    holds now.

    Megatron's modules keep the groups they were built with (``tp_group``,
    ``pp_group``, ``embd_group``, ``cp_group``, ``pg_collection``; an MoE layer's
    experts and token dispatcher their expert groups), but the time-sharing cycle
    destroys those after every step: without this the layers would keep using the
    constructor's gloo group in every later step's NCCL group's place. A group
    attribute this cannot map is an error, not a stale link left behind."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP

    groups = ProcessGroupCollection.use_mpu_process_groups()
    for model in models:
        in_experts = {
            id(m) for e in model.modules() if isinstance(e, SequentialMLP) for m in e.modules()
        }
        for module in model.modules():
            _rebind(module, groups, _IN_EXPERTS if id(module) in in_experts else {})
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is not None:
                _rebind(dispatcher, groups, {"tp_group": "expt_tp"})


def _rebind(obj: object, groups: Any, renamed: dict[str, str]) -> None:
    from megatron.core.process_groups_config import ProcessGroupCollection

    for name, value in list(vars(obj).items()):
        if isinstance(value, ProcessGroupCollection):
            setattr(obj, name, groups)
        elif isinstance(value, dist.ProcessGroup):
            field = renamed.get(name) or _RENAMED.get(name) or name.removesuffix("_group")
            new = getattr(groups, field, None)
            if not name.endswith("_group") or not isinstance(new, dist.ProcessGroup):
                raise RuntimeError(
                    f"{type(obj).__name__}.{name}: a process group the Megatron "
                    "trainer does not rebuild with each step's groups"
                )
            setattr(obj, name, new)
