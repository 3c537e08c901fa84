"""The Megatron-core trainer on a CUDA device (tests/integration/test_megatron.py is the
host's share): a step on the device (Megatron's CUDA RNG tracker seeded: attention
forks it around dropout), offload that empties the device and a reload that restores
the state bit for bit, and the exported weights an HF model loads with the same
logits. Needs megatron-core (scripts/gpu-wheels carries it): missing, these fail."""

from __future__ import annotations

import gc
import math

import pytest
import torch
from helpers.trainer import assert_same_state, mass_below_8, sample_batch, state_snapshot

from rlix_async.config import MegatronTrainConfig, ModelConfig
from rlix_async.models.tiny import tiny_llama
from rlix_async.protocols.batch import Group

SMALL = {"vocab_size": 64, "layers": 1, "hidden": 64}
MEDIUM = {"vocab_size": 8192, "layers": 4, "hidden": 512}
MiB = 1 << 20
BATCH = [Group([1, 2], [[3, 4, 5], [6, 7, 8]], [[-4.0] * 3] * 2, [[0] * 3] * 2, [1.0, 0.0])] * 2


def _trainer(shape: dict[str, int], **train: object):  # type: ignore[no-untyped-def]
    from rlix_async.train.megatron import MegatronTrainer

    return MegatronTrainer(MegatronTrainConfig(**train), ModelConfig(**shape), seed=0)  # type: ignore[arg-type]


class _Hf:
    """sample_batch/mass_below_8 read ``.model`` as an HF model: the exported weights."""

    def __init__(self, shape: dict[str, int]) -> None:
        self.model = tiny_llama(0, **shape).eval().cuda()


def test_megatron_steps_on_the_device_learn_with_a_seeded_rng_tracker() -> None:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    t = _trainer(SMALL, lr=1e-2)
    assert {p.device.type for p in t.model.parameters()} == {"cuda"}
    view = _Hf(SMALL)
    view.model.load_state_dict(t.weights_for_cache())
    gen = torch.Generator().manual_seed(0)
    before = mass_below_8(view)  # type: ignore[arg-type]
    for _ in range(8):
        stats = t.train_step(sample_batch(view, gen))  # type: ignore[arg-type]
        assert math.isfinite(stats["loss"])
        view.model.load_state_dict(t.weights_for_cache())
    assert get_cuda_rng_tracker().is_initialized()
    assert "model-parallel-rng" in get_cuda_rng_tracker().get_states()
    assert mass_below_8(view) > 2 * before  # type: ignore[arg-type]


def test_megatron_offload_empties_the_device_and_reload_restores_it() -> None:
    gc.collect()
    torch.cuda.empty_cache()
    allocated0 = torch.cuda.memory_allocated()
    t = _trainer(MEDIUM, dtype="float32")
    t.train_step(BATCH)  # the optimizer state exists from here on
    for i in range(5):
        before = state_snapshot(t) if i in (0, 4) else None
        t.offload()
        assert torch.cuda.memory_allocated() - allocated0 < MiB
        t.reload()
        if before is not None:
            assert_same_state(state_snapshot(t), before)
        assert math.isfinite(t.train_step(BATCH)["loss"])


def test_megatron_exports_weights_an_hf_model_runs_with_the_same_logits() -> None:
    t = _trainer(SMALL, dtype="float32")
    t.train_step(BATCH)
    hf = tiny_llama(0, **SMALL).eval().cuda()
    hf.load_state_dict(t.weights_for_cache(), strict=True)
    ids = torch.tensor([[5, 17, 30, 2, 9]], device="cuda")
    t.parallel_state(None)
    try:
        with torch.no_grad():
            mg = t.parallel.logits(t.model.eval(), ids).float()
            ref = hf(input_ids=ids).logits.float()
    finally:
        t.destroy_group()
    assert torch.allclose(mg, ref, atol=1e-4, rtol=1e-4), (mg - ref).abs().max()


def test_a_bf16_megatron_step_on_the_device_is_finite_and_moves_the_weights() -> None:
    t = _trainer(SMALL, dtype="bfloat16", lr=1e-3)
    start = {k: v.detach().float().clone() for k, v in t.weights_for_cache().items()}
    stats = t.train_step(BATCH)
    assert math.isfinite(stats["loss"])
    after = t.weights_for_cache()
    assert any(not torch.equal(after[k].float(), v) for k, v in start.items())


@pytest.mark.gpu2
@pytest.mark.parametrize("backend", ["megatron", "megatron_tp2", "megatron_pp2", "megatron_ep2"])
def test_twenty_megatron_cycles_on_two_devices(tmp_path, backend: str) -> None:  # type: ignore[no-untyped-def]
    """Data, tensor, pipeline and expert parallel 2 over NCCL: nothing left on the
    devices."""
    from helpers.tiny_text import save_tiny_model
    from helpers.trainer import run_cycles

    moe = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=3) if backend.endswith("ep2") else ""
    run_cycles(tmp_path, backend, cuda=True, model=str(moe))


@pytest.mark.gpu2
def test_megatron_expert_parallel_on_two_devices_matches_data_parallel(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A tiny Qwen3-MoE at expert parallel 2 over NCCL (Megatron's all-to-all
    dispatcher on CUDA, its own streams) against data parallel 2: the cache gathered
    from both ranks' experts is the same bytes, a step's loss and norm agree."""
    from helpers.megatron_tp_runs import run_tp
    from helpers.tiny_text import save_tiny_model

    moe = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=3, tie_word_embeddings=False)
    dp = run_tp(tmp_path / "dp2", moe, 1, 2, 2, cuda=True)
    ep = run_tp(tmp_path / "ep2", moe, 1, 2, 2, ep=2, cuda=True)
    for k, v in dp["cache_start"].items():
        assert torch.equal(ep["cache_start"][k].cpu(), v.cpu()), k
    for a, b in zip(dp["figures"], ep["figures"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)


@pytest.mark.gpu2
@pytest.mark.parametrize(("tp", "pp", "tied"), [(2, 1, False), (1, 2, True)])
def test_megatron_model_parallel_on_two_devices_matches_one(  # type: ignore[no-untyped-def]
    tmp_path, tp: int, pp: int, tied: bool
) -> None:
    """NCCL's tensor-parallel group (or the 1F1B schedule's sends and receives between
    two stages, with the tied embedding's copies on both) on two devices against one
    device: the cache built from the gathered weights is the same bytes, logits and a
    step's loss agree."""
    from helpers.megatron_tp_runs import run_tp

    from rlix_async.models.tiny import save_tiny_llama

    model = save_tiny_llama(
        tmp_path / "model", seed=3, vocab_size=63, layers=2, hidden=128, tied=tied
    )
    one = run_tp(tmp_path / "tp1", model, 1, 1, 2, cuda=True)
    two = run_tp(tmp_path / "two", model, tp, 2, 2, pp=pp, cuda=True)
    for k, v in one["cache_start"].items():
        assert torch.equal(two["cache_start"][k].cpu(), v.cpu()), k
    torch.testing.assert_close(two["logits"].cpu(), one["logits"].cpu(), atol=1e-4, rtol=1e-4)
    for a, b in zip(one["figures"], two["figures"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-5)
