"""HF Llama <-> Megatron GPT weight names and layouts (pure tensor maths: no Megatron).
The logits check that the layouts are the ones Megatron computes with is in
tests/integration/test_megatron.py."""

from __future__ import annotations

import pytest
import torch

from rlix_async.train.megatron_hf import hf_to_megatron, megatron_to_hf


def hf_llama(
    layers: int, hidden: int, heads: int, groups: int, head_dim: int
) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    sd = {
        "model.embed_tokens.weight": r(32, hidden),
        "model.norm.weight": r(hidden),
        "lm_head.weight": r(32, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        sd |= {
            p + "input_layernorm.weight": r(hidden),
            p + "post_attention_layernorm.weight": r(hidden),
            p + "self_attn.q_proj.weight": r(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": r(groups * head_dim, hidden),
            p + "self_attn.v_proj.weight": r(groups * head_dim, hidden),
            p + "self_attn.o_proj.weight": r(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": r(48, hidden),
            p + "mlp.up_proj.weight": r(48, hidden),
            p + "mlp.down_proj.weight": r(hidden, 48),
        }
    return sd


@pytest.mark.parametrize("heads,groups", [(4, 4), (4, 2), (6, 2), (3, 1)])
def test_hf_to_megatron_and_back_is_the_identity(heads: int, groups: int) -> None:
    hf = hf_llama(2, 24, heads, groups, 8)
    back = megatron_to_hf(hf_to_megatron(hf, heads, groups, 8, tied=False), heads, groups, 8)
    assert back.keys() == hf.keys()
    for k, v in hf.items():
        assert torch.equal(back[k], v), k


def test_grouped_query_attention_puts_each_groups_heads_beside_its_k_and_v() -> None:
    # Megatron's fused qkv, per group: that group's q heads, its k head, its v head
    heads, groups, d = 4, 2, 8
    hf = hf_llama(1, 16, heads, groups, d)
    qkv = hf_to_megatron(hf, heads, groups, d, tied=False)[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    second_group = qkv[(2 + 2) * d : 2 * (2 + 2) * d]
    assert torch.equal(second_group[: 2 * d], q[2 * d : 4 * d])  # q heads 2 and 3
    assert torch.equal(second_group[2 * d : 3 * d], k[d : 2 * d])
    assert torch.equal(second_group[3 * d :], v[d : 2 * d])


def test_tied_embeddings_leave_the_output_layer_to_the_embedding() -> None:
    hf = hf_llama(1, 16, 2, 2, 8)
    mg = hf_to_megatron(hf, 2, 2, 8, tied=True)
    assert "output_layer.weight" not in mg
    assert "output_layer.weight" in hf_to_megatron(hf, 2, 2, 8, tied=False)


def test_an_unknown_or_incomplete_weight_is_refused() -> None:
    hf = hf_llama(1, 16, 2, 2, 8)
    with pytest.raises(KeyError, match="no Megatron name"):
        hf_to_megatron({**hf, "model.rotary_emb.inv_freq": torch.zeros(4)}, 2, 2, 8, tied=False)
    del hf["model.layers.0.self_attn.v_proj.weight"]
    with pytest.raises(KeyError, match="lacks"):
        hf_to_megatron(hf, 2, 2, 8, tied=False)
