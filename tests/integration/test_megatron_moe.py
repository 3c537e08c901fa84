"""Mixture-of-experts models in the Megatron backend (train/megatron_moe.py): an HF
Qwen3-MoE directory trains as a Megatron GPTModel with MoE layers, exactly.

Tiny random Qwen3-MoE directories written by transformers (4 experts, top 2, QK-norm):
the trainer's logits are transformers' own, the cache holds the directory's tensors
byte for byte under the names it was saved with (per expert, what vLLM's loader and
``from_pretrained`` take), GRPO steps learn through the time-sharing cycle (the
experts' and token dispatcher's process groups rebuilt each step), and a layout not
built for MoE is refused in one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.trainer import megatron_logits

pytest.importorskip("megatron.core")
pytestmark = [pytest.mark.slow, pytest.mark.beside_heavy]  # in-process trainers


def _directory(tmp_path: Path, **config: object) -> Path:
    from helpers.tiny_text import save_tiny_model

    return save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=4, **config)


@pytest.mark.parametrize(
    "config",
    [
        # every layer MoE, the router's top 2 renormalized (Qwen3-MoE's checkpoints)
        {"norm_topk_prob": True},
        # layer 0 dense (mlp_only_layers), top 2 not renormalized: Megatron's pre-softmax
        {"norm_topk_prob": False, "mlp_only_layers": [0], "tie_word_embeddings": False},
    ],
    ids=["all-moe", "dense-first-unnormalized"],
)
def test_a_qwen3_moe_directory_trains_as_megatron_with_its_own_logits_and_tensors(
    tmp_path: Path, config: dict[str, object]
) -> None:
    import transformers
    from safetensors.torch import load_file

    from rlix_async.config import ModelConfig
    from rlix_async.train.megatron import MegatronTrainer
    from rlix_async.train.megatron_hf import hf_to_megatron

    path = _directory(tmp_path, **config)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    t = MegatronTrainer(model=ModelConfig(path=str(path)), seed=0)
    moe_layers = [type(layer.mlp).__name__ for layer in t.model.decoder.layers]
    assert moe_layers == (
        ["MLP", "MoELayer"] if config.get("mlp_only_layers") else ["MoELayer"] * 2
    )
    # the cache: the saved tensors, bit for bit, under their saved per-expert names
    saved = load_file(str(path / "model.safetensors"))
    if config.get("tie_word_embeddings", True):
        saved.pop("lm_head.weight", None)
    cache = t.weights_for_cache()
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in cache
    assert cache.keys() == saved.keys()
    assert all(torch.equal(cache[k], v) for k, v in saved.items())
    # the per-expert names read directly give the model transformers' fused ones gave
    s = t._shape
    direct = hf_to_megatron(saved, s["heads"], s["groups"], s["head_dim"], tied=s["tied"])
    state = {k: v for k, v in t.model.state_dict().items() if "_extra_state" not in k}
    assert direct.keys() == state.keys()
    assert all(torch.equal(direct[k], v) for k, v in state.items())
    # float32 both sides, the same routing: only the summation order differs
    ids = torch.tensor([[5, 17, 30, 2, 9, 44, 61, 3]])
    mg = megatron_logits(t, ids)
    assert torch.allclose(mg, hf(input_ids=ids).logits, atol=1e-5)


def test_grpo_steps_on_a_moe_model_learn_through_the_time_sharing_cycle(tmp_path: Path) -> None:
    """Each step builds and destroys Megatron's parallel state: the MoE layers' router,
    experts and token dispatcher are pointed at the new groups every time (a stale
    group raises at the next step's first collective). The policy samples from the
    trainer's weights as transformers loads them from the cache's names."""
    import transformers
    from helpers.trainer import mass_below_8, sample_batch
    from safetensors.torch import save_file

    from rlix_async.config import MegatronTrainConfig, ModelConfig
    from rlix_async.train.megatron import MegatronTrainer

    path = _directory(tmp_path, vocab_size=64)  # as the dense test's: tokens < 8 ~ 1/8
    t = MegatronTrainer(MegatronTrainConfig(lr=1e-2), ModelConfig(path=str(path)), seed=0)
    gen = torch.Generator().manual_seed(0)

    class View:  # sample_batch/mass_below_8 read `.model` as an HF model
        model: torch.nn.Module

    def reload() -> None:  # the cache's names, as a shard or `export` would write them
        save_file({k: v.contiguous() for k, v in t.weights_for_cache().items()},
                  str(path / "model.safetensors"))  # fmt: skip
        View.model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()

    reload()
    before = mass_below_8(View)  # type: ignore[arg-type]
    router = t.model.decoder.layers[0].mlp.router.weight.detach().clone()
    for _ in range(8):
        t.train_step(sample_batch(View, gen))  # type: ignore[arg-type]
        reload()
    assert not torch.equal(router, t.model.decoder.layers[0].mlp.router.weight.detach())
    assert mass_below_8(View) > 2 * before  # type: ignore[arg-type]
    # at one rank a stale group of size 1 still "works": check what each holds instead
    t.parallel_state(None)
    try:
        _assert_groups_are_the_current_ones(t.model)
    finally:
        t.destroy_group()


def _assert_groups_are_the_current_ones(model: torch.nn.Module) -> None:
    """Every process group the model's modules and token dispatchers hold is the one
    of Megatron's parallel state now, the experts' being the expert groups."""
    import torch.distributed as dist
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.experts import SequentialMLP

    groups = ProcessGroupCollection.use_mpu_process_groups()
    current = {id(g) for g in vars(groups).values() if isinstance(g, dist.ProcessGroup)}
    dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
    assert dispatchers
    stale = [
        (type(o).__name__, name)
        for o in [*model.modules(), *dispatchers]
        for name, v in vars(o).items()
        if isinstance(v, dist.ProcessGroup) and id(v) not in current
    ]
    assert not stale
    for experts in [m for m in model.modules() if isinstance(m, SequentialMLP)]:
        for m in experts.modules():
            if hasattr(m, "tp_group"):
                assert m.tp_group is groups.expt_tp, type(m).__name__
        assert experts.dp_group is groups.expt_dp
    for d in dispatchers:
        assert (d.tp_group, d.ep_group, d.tp_ep_group) == (groups.expt_tp, groups.ep, groups.tp_ep)


def test_a_moe_model_at_a_layout_not_built_for_it_is_refused_in_one_line(
    tmp_path: Path,
) -> None:
    from rlix_async.train.megatron_hf import model_shape
    from rlix_async.train.megatron_moe import check_moe_layout
    from rlix_async.train.tensor_parallel import LayoutError

    moe = model_shape(str(_directory(tmp_path)))["moe"]
    # transformers' Qwen3MoeConfig leaves norm_topk_prob off (Qwen3-MoE's checkpoints
    # turn it on): the top 2 of a softmax over all experts, Megatron's pre-softmax
    assert moe == {"experts": 4, "topk": 2, "ffn": 64, "layers": [1, 1], "pre_softmax": True}
    check_moe_layout(moe, 1, 1)
    check_moe_layout(moe, 1, 2, 2)  # pipeline and expert parallel: the all-to-all dispatcher
    check_moe_layout(None, 2, 2)  # a dense model: any layout its shape allows
    for (tp, pp, ep), why in (
        ((2, 1, 1), "sequence parallel"),
        ((2, 2, 2), "sequence parallel"),
        ((1, 1, 3), "4 experts do not split"),
    ):
        with pytest.raises(LayoutError, match=why) as err:
            check_moe_layout(moe, tp, pp, ep)
        assert "\n" not in str(err.value)
    with pytest.raises(LayoutError, match="needs a mixture-of-experts model"):
        check_moe_layout(None, 1, 1, 2)
