"""The Megatron-core trainer backend: a Llama-shaped ``GPTModel``, exported under HF names.

Same interface and time-sharing cycle as :class:`TorchTrainer` (per-step
process groups, offload, cache export), with Megatron's parallel state built
and destroyed together with the group. Weights leave in HF ``LlamaForCausalLM``
names (``megatron_to_hf``) because that is what vLLM's loader takes; the
conversion is exact (tests compare logits). Tensor/pipeline parallel sizes are
1 here: data parallel over torchrun ranks via DDP. On CPU it needs
``megatron_cpu_compat`` (megatron-core 0.16.1 assumes CUDA in two places).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from rlix_async.config import ModelConfig
from rlix_async.train.buffer import Group
from rlix_async.train.trainer import TorchTrainer, cast_floats, cast_parameters


def _llama_shape(model: ModelConfig) -> dict[str, int]:
    m = model.tiny
    return {**m, "heads": m["hidden"] // 64, "head_dim": 64, "ffn": 2 * m["hidden"]}


def megatron_to_hf(
    sd: Mapping[str, torch.Tensor | None], heads: int, groups: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Megatron GPT (local spec, RMSNorm, SwiGLU, RoPE) -> HF Llama state dict."""
    out: dict[str, torch.Tensor] = {}
    per = heads // groups
    top = {
        "embedding.word_embeddings.weight": "model.embed_tokens.weight",
        "decoder.final_layernorm.weight": "model.norm.weight",
        "output_layer.weight": "lm_head.weight",
    }
    simple = {
        "input_layernorm.weight": "input_layernorm.weight",
        "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
        "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
        "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    }
    for key, value in sd.items():
        if value is None or "_extra_state" in key:
            continue
        v = value.detach()
        if key in top:
            out[top[key]] = v
            continue
        parts = key.split(".")
        if parts[:2] != ["decoder", "layers"]:
            raise KeyError(f"no HF name for Megatron weight {key}")
        pre, rest = f"model.layers.{parts[2]}.", ".".join(parts[3:])
        if rest in simple:
            out[pre + simple[rest]] = v
        elif rest == "mlp.linear_fc1.weight":  # [gate; up]
            gate, up = v.chunk(2, 0)
            out[pre + "mlp.gate_proj.weight"], out[pre + "mlp.up_proj.weight"] = gate, up
        elif rest == "self_attention.linear_qkv.weight":  # per group: q heads, k, v
            w = v.view(groups, (per + 2) * head_dim, -1)
            out[pre + "self_attn.q_proj.weight"] = w[:, : per * head_dim].reshape(
                heads * head_dim, -1
            )
            out[pre + "self_attn.k_proj.weight"] = w[
                :, per * head_dim : (per + 1) * head_dim
            ].reshape(groups * head_dim, -1)
            out[pre + "self_attn.v_proj.weight"] = w[:, (per + 1) * head_dim :].reshape(
                groups * head_dim, -1
            )
        else:
            raise KeyError(f"no HF name for Megatron weight {key}")
    return out


class MegatronTrainer(TorchTrainer):
    def _parallel_state(self, store: dist.Store | None) -> None:
        from megatron.core import parallel_state

        if not dist.is_initialized():
            self._group_gen += 1
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # per thread: the pipeline trains in one
            dist.init_process_group(
                "nccl" if self.device.type == "cuda" else "gloo",
                store=dist.PrefixStore(f"rlix-mg-{self._group_gen}", store or dist.HashStore()),
                rank=self.rank if store is not None else 0,
                world_size=self.world if store is not None else 1,
            )
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)

    def _build_model(self) -> torch.nn.Module:
        from rlix_async.train import megatron_cpu_compat

        megatron_cpu_compat.apply()  # before Megatron is imported or used (CPU only)
        import torch.nn.functional as F
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        if self.model_cfg.path:
            raise ValueError("the Megatron backend builds its model from `model`, not a path")
        self._parallel_state(None)  # building the model needs Megatron's parallel state
        s = _llama_shape(self.model_cfg)
        torch.manual_seed(self.seed)
        tc = TransformerConfig(
            num_layers=s["layers"],
            hidden_size=s["hidden"],
            num_attention_heads=s["heads"],
            kv_channels=s["head_dim"],
            ffn_hidden_size=s["ffn"],
            normalization="RMSNorm",
            layernorm_epsilon=1e-6,
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
        )
        model = GPTModel(
            config=tc,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=s["vocab_size"],
            max_sequence_length=4096,
            position_embedding_type="rope",
            rotary_base=10000,
            share_embeddings_and_output_weights=False,
        )
        self.destroy_group()  # the time-sharing cycle creates groups per step
        return cast_parameters(model, self.dtype)  # the local spec's norms ignore params_dtype

    def init_group(self, store: dist.Store | None) -> None:
        self._require_on_device("init_group()")
        self._parallel_state(store if self.world > 1 else None)
        if self.world > 1:
            self._wrap_ddp()

    def destroy_group(self) -> None:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        super().destroy_group()  # DDP, then the default group

    def forward_logits(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        pos = torch.arange(n, device=ids.device).unsqueeze(0).expand_as(ids)
        causal = torch.triu(torch.ones(n, n, device=ids.device), diagonal=1).bool()[None, None]
        return model(ids, pos, attention_mask=causal)

    def train_step(self, groups: list[Group]) -> dict[str, float]:
        if not dist.is_initialized():  # running alone: a private one-rank group
            self._parallel_state(None)
            try:
                return super().train_step(groups)
            finally:
                self.destroy_group()
        return super().train_step(groups)

    def weights_for_cache(self) -> dict[str, torch.Tensor]:
        s = _llama_shape(self.model_cfg)
        hf = megatron_to_hf(self.model.state_dict(), s["heads"], s["heads"], s["head_dim"])
        return cast_floats(hf, self.dtype)
