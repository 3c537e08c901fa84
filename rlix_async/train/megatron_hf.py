"""Megatron's GPTModel and HF Llama or Qwen3-MoE, one to the other: the shape of an HF
directory (other families refused in one line), both weight conversions (exact: tests
compare logits; the experts' names in train/megatron_moe.py), and reading only one
tensor-parallel rank's slices of a safetensors directory. Used by the Megatron trainer
(train/megatron.py), the launcher's model check and ``rlix-async export``."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from rlix_async.train.megatron_moe import MODEL_TYPES as MOE_TYPES
from rlix_async.train.megatron_moe import expert_to_hf, experts_to_megatron, moe_shape
from rlix_async.train.pipeline_parallel import stage_layers
from rlix_async.train.tensor_parallel import hf_part


class MegatronModelError(ValueError):
    """A model directory the Megatron backend cannot load. One line."""


def model_shape(path: str) -> dict[str, Any]:
    """The GPTModel shape of an HF Llama-family or Qwen3-MoE directory;
    MegatronModelError for a model this backend would build wrong (another family,
    biases, scaled RoPE)."""
    import transformers

    try:
        c = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise MegatronModelError(f"{path}: no readable config.json ({exc})") from None
    if c.model_type not in ("llama", *MOE_TYPES):
        raise MegatronModelError(
            f"{path}: the megatron backend loads Llama-family checkpoints (model_type "
            f"llama) and {', '.join(MOE_TYPES)}, not {c.model_type}; use train.backend torch"
        )
    # transformers 5 keeps rope_theta in rope_parameters; 4.x on the config itself
    rope = getattr(c, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    scaling = getattr(c, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        rope_type = scaling.get("rope_type", scaling.get("type"))
    unsupported = {
        "attention_bias": getattr(c, "attention_bias", False),
        "mlp_bias": getattr(c, "mlp_bias", False),
        f"rope_type {rope_type}": rope_type != "default",
        f"hidden_act {c.hidden_act}": c.hidden_act != "silu",
    }
    if any(unsupported.values()):
        what = ", ".join(k for k, v in unsupported.items() if v)
        raise MegatronModelError(
            f"{path}: the megatron backend builds no biases, default RoPE and SwiGLU; "
            f"this model has {what}; use train.backend torch"
        )
    heads = c.num_attention_heads
    return {
        "vocab_size": c.vocab_size,
        "layers": c.num_hidden_layers,
        "hidden": c.hidden_size,
        "heads": heads,
        "groups": getattr(c, "num_key_value_heads", None) or heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // heads,
        "ffn": c.intermediate_size,
        "eps": float(c.rms_norm_eps),
        "rope_base": float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        "tied": bool(c.tie_word_embeddings),
        "max_len": c.max_position_embeddings,
        "qk_norm": c.model_type in MOE_TYPES,  # Qwen3's RMSNorm of each head's q and k
        "moe": moe_shape(c) if c.model_type in MOE_TYPES else None,
    }


# Megatron names -> HF Llama names of the weights that map one to one (the fused
# qkv and gate/up are split and joined in the functions below); hf_to_megatron
# uses the inverse.
_TOP_TO_HF = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_LAYER_TO_HF = {  # within decoder.layers.N. / model.layers.N.
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",  # Qwen3
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.router.weight": "mlp.gate.weight",  # an MoE layer's router
}


def megatron_to_hf(
    sd: Mapping[str, torch.Tensor | None], heads: int, groups: int, head_dim: int
) -> dict[str, torch.Tensor]:
    """Megatron GPT (local spec, RMSNorm, SwiGLU, RoPE; MoE layers' experts per
    expert) -> HF Llama or Qwen3-MoE state dict."""
    out: dict[str, torch.Tensor] = {}
    per = heads // groups
    top, simple = _TOP_TO_HF, _LAYER_TO_HF
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
        elif (experts := expert_to_hf(rest, v)) is not None:
            out.update({pre + k: t for k, t in experts.items()})
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


def hf_to_megatron(
    sd: Mapping[str, torch.Tensor], heads: int, groups: int, head_dim: int, *, tied: bool
) -> dict[str, torch.Tensor]:
    """HF Llama or Qwen3-MoE state dict -> Megatron GPT (the inverse of
    :func:`megatron_to_hf`; experts per expert or fused as transformers holds them).
    With ``tied`` embeddings the output layer is the embedding: ``lm_head`` is dropped."""
    out: dict[str, torch.Tensor] = {}
    per = heads // groups
    top = {hf: meg for meg, hf in _TOP_TO_HF.items()}
    simple = {hf: meg for meg, hf in _LAYER_TO_HF.items()}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    for key, v in sd.items():
        if key in top:
            if not (tied and key == "lm_head.weight"):
                out[top[key]] = v
            continue
        parts = key.split(".")
        if parts[:2] != ["model", "layers"]:
            raise KeyError(f"no Megatron name for HF weight {key}")
        pre, rest = f"decoder.layers.{parts[2]}.", ".".join(parts[3:])
        if rest in simple:
            out[pre + simple[rest]] = v
        else:
            layers.setdefault(pre, {})[rest] = v  # fused below, once all parts are seen
    for pre, w in layers.items():
        try:
            q, k, v = (w.pop(f"self_attn.{n}_proj.weight") for n in "qkv")
            if "mlp.gate_proj.weight" in w or "mlp.up_proj.weight" in w:  # a dense MLP
                gate, up = w.pop("mlp.gate_proj.weight"), w.pop("mlp.up_proj.weight")
                out[pre + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)  # [gate; up]
            else:
                out.update(experts_to_megatron(w, pre))
        except KeyError as exc:
            raise KeyError(f"layer {pre} lacks {exc}") from None
        if w:
            raise KeyError(f"no Megatron name for HF weights {sorted(w)} of {pre}")
        hidden = q.shape[1]
        qkv = torch.cat(  # per group: its q heads, then its k, then its v
            [
                q.view(groups, per * head_dim, hidden),
                k.view(groups, head_dim, hidden),
                v.view(groups, head_dim, hidden),
            ],
            dim=1,
        )
        out[pre + "self_attention.linear_qkv.weight"] = qkv.reshape(-1, hidden)
    return out


def stage_reads(stage: int, pp: int, layers: int, tied: bool) -> Callable[[str], bool]:
    """Which HF Llama tensors pipeline stage ``stage`` of ``pp`` holds: its layers, the
    embedding on the first stage, the final norm and output layer on the last (with
    tied embeddings the last stage's output layer is the embedding, so it reads that)."""
    mine = stage_layers(layers, pp, stage)
    first, last = stage == 0, stage == pp - 1

    def wanted(name: str) -> bool:
        if name.startswith("model.layers."):
            return int(name.split(".")[2]) in mine
        if name == "model.embed_tokens.weight":
            return first or (last and tied)
        return last  # model.norm, lm_head

    return wanted


def read_hf_part(
    path: str,
    shape: Mapping[str, Any],
    rank: int,
    tp: int,
    wanted: Callable[[str], bool] = lambda name: True,
) -> dict[str, torch.Tensor] | None:
    """Rank ``rank``'s slices of the ``wanted`` tensors of the safetensors files of
    ``path``, in float32 (None: the directory has none, e.g. only .bin files: read
    whole)."""
    from safetensors import safe_open

    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        return None
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(root / f), framework="pt") as h:
            for name in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if name.endswith("rotary_emb.inv_freq") or not wanted(name):
                    continue  # a buffer older conversions saved; transformers skips it too
                sl = h.get_slice(name)
                part = hf_part(name, sl.get_shape(), rank, tp, shape)
                if part is None:
                    t = sl[:]
                else:
                    dim, lo, hi = part
                    t = sl[lo:hi] if dim == 0 else sl[:, lo:hi]
                out[name] = t.to(torch.float32)
    return out
