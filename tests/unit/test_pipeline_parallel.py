"""How Megatron weights split over pipeline stages (train/pipeline_parallel.py) and
which HF tensors each stage reads (train/megatron_hf.stage_reads): pure functions."""

from __future__ import annotations

import pytest
import torch

from rlix_async.train.megatron_hf import stage_reads
from rlix_async.train.pipeline_parallel import (
    EMBEDDING,
    check_layers,
    from_stage,
    full_param_order,
    global_name,
    to_stage,
)
from rlix_async.train.tensor_parallel import LayoutError

LAYERS = 4
PER_LAYER = ("input_layernorm.weight", "self_attention.linear_qkv.weight",
             "self_attention.linear_qkv._extra_state", "mlp.linear_fc1.weight")  # fmt: skip


def full_state(tied: bool) -> dict[str, object]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, object] = {EMBEDDING: torch.randn(11, 4, generator=g)}
    for i in range(LAYERS):
        for rest in PER_LAYER:
            out[f"decoder.layers.{i}.{rest}"] = (
                None if rest.endswith("_extra_state") else torch.randn(4, generator=g)
            )
    out["decoder.final_layernorm.weight"] = torch.randn(4, generator=g)
    out["output_layer._extra_state"] = None
    if not tied:
        out["output_layer.weight"] = torch.randn(11, 4, generator=g)
    return out


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stages_hold_every_weight_once_and_give_it_back_exactly(pp: int, tied: bool) -> None:
    full = full_state(tied)
    back: dict[str, object] = {}
    for stage in range(pp):
        local = to_stage(full, stage, pp, LAYERS, tied)
        numbers = {int(k.split(".")[2]) for k in local if k.startswith("decoder.layers.")}
        assert numbers == set(range(LAYERS // pp))  # local numbers from 0 on every stage
        assert (EMBEDDING in local) == (stage == 0)
        last = stage == pp - 1
        assert ("decoder.final_layernorm.weight" in local) == last
        # the last stage's output layer: its own, or with tied embeddings the embedding
        assert ("output_layer.weight" in local) == (last and (not tied or pp > 1))
        if last and tied and pp > 1:
            assert local["output_layer.weight"] is full[EMBEDDING]
        part = from_stage(local, stage, pp, LAYERS, tied)
        assert not part.keys() & back.keys()  # nothing on two stages (the tied copy aside)
        back.update(part)
    assert back.keys() == full.keys()
    assert all(back[k] is v for k, v in full.items())


def test_names_map_to_the_whole_model() -> None:
    name = "decoder.layers.1.mlp.linear_fc1.weight"
    assert global_name(name, 1, 2, LAYERS, False) == "decoder.layers.3.mlp.linear_fc1.weight"
    assert global_name("output_layer.weight", 1, 2, LAYERS, True) is None  # the tied copy
    assert global_name("output_layer.weight", 1, 2, LAYERS, False) == "output_layer.weight"
    with pytest.raises(KeyError, match="no pipeline stage"):
        to_stage({"something.else": torch.zeros(1)}, 0, 2, LAYERS, False)


@pytest.mark.parametrize("tied", [False, True])
def test_the_whole_models_optimizer_order_from_any_stage(tied: bool) -> None:
    """The order a one-rank trainer's optimizer holds its parameters in (embedding,
    layers, final norm, untied output layer), rebuilt from either stage's own."""
    full = [k for k, v in full_state(tied).items() if v is not None]
    for stage in range(2):
        local = [k for k, v in to_stage(full_state(tied), stage, 2, LAYERS, tied).items() if v is not None]  # fmt: skip
        assert full_param_order(local, LAYERS, tied) == full


def test_each_stage_reads_only_its_hf_tensors() -> None:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.mlp.up_proj.weight" for i in range(LAYERS)
    ]
    first, last = stage_reads(0, 2, LAYERS, tied=False), stage_reads(1, 2, LAYERS, tied=False)
    assert [n for n in names if first(n)] == [names[0], names[3], names[4]]
    assert [n for n in names if last(n)] == [names[1], names[2], names[5], names[6]]
    tied_last = stage_reads(1, 2, LAYERS, tied=True)
    assert tied_last("model.embed_tokens.weight")  # its output layer is the embedding
    middle = stage_reads(1, 4, LAYERS, tied=True)
    assert [n for n in names if middle(n)] == [names[4]]


def test_layers_must_split_evenly() -> None:
    check_layers(30, 2)
    with pytest.raises(LayoutError, match="layers \\(30\\)"):
        check_layers(30, 4)
