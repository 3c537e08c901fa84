"""The Megatron trainer at tensor parallel 2 against tensor parallel 1, under torchrun
on this CPU (gloo): the same HF weights load into both layouts; the gathered weight
cache is the same bytes; logits, one step's loss and gradient norm agree; a
checkpoint written at tp=2 holds the whole model and resumes exactly at tp=2 and at
tp=1 (resharding). The vocabulary (63) is odd, so tp=2 pads it and must unpad it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.megatron_tp_runs import assert_same_weights, run_jobs

pytest.importorskip("megatron.core")
# the module's runs (torchrun jobs of 1-4 ranks on 2 cores, beside the other pytest
# worker) are set up by the first test: several minutes under CI's load
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("megatron_tp")]  # one fixture

SHAPE = {"vocab_size": 63, "layers": 2, "hidden": 128}  # 2 heads, 2 query groups


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from rlix_async.models.tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("tp")
    model = save_tiny_llama(root / "model", seed=3, **SHAPE)
    tied = save_tiny_llama(root / "tied", seed=4, tied=True, **SHAPE)
    # in the order the checkpoints they resume from are written; one torchrun per world
    out = run_jobs(root, 1, {
        "tp1": {"model": model, "tp": 1, "steps": 2},
        # under top-p the logits are gathered (the nucleus sorts the whole vocabulary)
        "tp1_top_p": {"model": model, "tp": 1, "steps": 2, "top_p": 0.9},
    })  # fmt: skip
    out |= run_jobs(root, 2, {
        "tp2": {"model": model, "tp": 2, "steps": 2},
        # two replicas each, of a model whose output layer is its embedding
        "tp1_dp2_tied": {"model": tied, "tp": 1, "steps": 2},
        "tp2_resumed": {"model": model, "tp": 2, "steps": 1, "ckpt": root / "tp2" / "ckpt_1"},
        # a one-rank trainer's step_1.pt (the whole model in one file), split at tp=2
        "tp2_from_tp1": {"model": model, "tp": 2, "steps": 1, "ckpt": root / "tp1" / "ckpt_1.pt"},
        "tp2_top_p": {"model": model, "tp": 2, "steps": 2, "top_p": 0.9},
    })  # fmt: skip
    # the distributed optimizer: each replica keeps and steps half the state
    zero = {"model": tied, "tp": 2, "distributed_optimizer": True}
    out |= run_jobs(root, 4, {
        "tp2_dp2_tied": {"model": tied, "tp": 2, "steps": 2},
        "zero": {**zero, "steps": 2},
        "zero_resumed": {**zero, "steps": 1, "ckpt": root / "zero" / "ckpt_1"},
    })  # fmt: skip
    ckpt = root / "zero" / "ckpt_1"
    out |= run_jobs(root, 2, {"tp1_from_zero": {"model": tied, "tp": 1, "steps": 1, "ckpt": ckpt}})
    ckpt = root / "tp2" / "ckpt_1"
    return out | run_jobs(root, 1, {"tp1_from_tp2": {"model": model, "tp": 1, "steps": 1, "ckpt": ckpt}})  # fmt: skip


def test_the_cache_built_at_tp2_is_the_bytes_of_tp1(runs: dict[str, dict]) -> None:
    one, two = runs["tp1"]["cache_start"], runs["tp2"]["cache_start"]
    assert one.keys() == two.keys() and one["model.embed_tokens.weight"].shape[0] == 63
    for k in one:
        assert one[k].dtype == two[k].dtype and torch.equal(one[k], two[k]), k


def test_logits_loss_and_gradient_norm_agree(runs: dict[str, dict]) -> None:
    one, two = runs["tp1"], runs["tp2"]
    assert one["logits"].shape == two["logits"].shape == (1, 6, 63)
    torch.testing.assert_close(two["logits"], one["logits"], atol=1e-5, rtol=1e-5)
    for a, b in zip(one["figures"], two["figures"], strict=True):
        # float32, summed in another order over the split matrices: relative 1e-5
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-4)
    assert_same_weights(
        runs["tp2"]["cache_end"], one["cache_end"]
    )  # the weights after two steps (lr 1e-3)


def test_a_tp2_checkpoint_resumes_exactly_at_tp2_and_at_tp1(runs: dict[str, dict]) -> None:
    second = runs["tp2"]["figures"][1]
    assert runs["tp2_resumed"]["figures"][0] == second  # bit for bit: the same layout
    torch.testing.assert_close(
        runs["tp2_resumed"]["cache_end"], runs["tp2"]["cache_end"], atol=0, rtol=0
    )
    resharded = runs["tp1_from_tp2"]["figures"][0]
    assert resharded["loss"] == pytest.approx(second["loss"], rel=1e-4, abs=1e-6)
    assert resharded["grad_norm"] == pytest.approx(second["grad_norm"], rel=1e-4)
    # the second minibatch's update used the resharded moments: the weights agree too
    assert_same_weights(runs["tp1_from_tp2"]["cache_end"], runs["tp2"]["cache_end"])


def test_two_replicas_of_tp2_with_tied_embeddings_train_as_two_of_tp1(
    runs: dict[str, dict],
) -> None:
    """Data parallel 2 at tp=2 (4 ranks) against dp=2 at tp=1: each replica's tokens
    counted once (not once per tensor-parallel rank), DDP averaging over the replicas
    only, and the tied output layer split as the embedding is."""
    one, two = runs["tp1_dp2_tied"], runs["tp2_dp2_tied"]
    assert "lm_head.weight" not in one["cache_start"]  # tied: the shards use the embedding
    for k, v in one["cache_start"].items():
        assert torch.equal(two["cache_start"][k], v), k
    for a, b in zip(one["figures"], two["figures"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    assert_same_weights(two["cache_end"], one["cache_end"])


def test_twenty_cycles_at_tensor_parallel_2_leak_nothing(tmp_path: Path) -> None:
    """Per step: the parallel state and every group built and destroyed, the gather onto
    rank 0; RSS flat after warm-up on both ranks (tests/helpers/trainer.py)."""
    from helpers.trainer import run_cycles

    rows = run_cycles(tmp_path, "megatron_tp2", timeout=380)
    assert rows[0]["weights"] and not rows[1]["weights"]


def test_a_one_rank_checkpoint_file_resumes_split_at_tp2(runs: dict[str, dict]) -> None:
    second = runs["tp1"]["figures"][1]
    resharded = runs["tp2_from_tp1"]["figures"][0]
    assert resharded["loss"] == pytest.approx(second["loss"], rel=1e-4, abs=1e-6)
    assert resharded["grad_norm"] == pytest.approx(second["grad_norm"], rel=1e-4)
    assert_same_weights(
        runs["tp2_from_tp1"]["cache_end"], runs["tp1"]["cache_end"]
    )  # the moments were split right too


def test_the_distributed_optimizer_makes_the_same_updates_from_half_the_state(
    runs: dict[str, dict],
) -> None:
    """tp=2 x dp=2 with the optimizer state sharded over the two replicas against the
    same layout without: the same figures and weights bit for bit (each weight is
    stepped by one replica with the same averaged gradient and sent to the other),
    each rank holding about half of its replica's state; its checkpoint (every rank's
    share a part of its own) resumes exactly, and at tp=1 x dp=2 without it."""
    full, zero = runs["tp2_dp2_tied"], runs["zero"]
    assert zero["figures"] == full["figures"]
    torch.testing.assert_close(zero["cache_end"], full["cache_end"], atol=0, rtol=0)
    held = [r["optim_elems"] for r in zero["rss"]]
    whole = [r["optim_elems"] for r in full["rss"]]
    # ranks 0 and 2 (1 and 3) are one tensor-parallel position in the two replicas
    for mine, other, alone in ((0, 2, 0), (1, 3, 1)):
        assert held[mine] + held[other] == whole[alone]
        assert max(held[mine], held[other]) < 0.6 * whole[alone]
    second = zero["figures"][1]
    assert runs["zero_resumed"]["figures"][0] == second
    torch.testing.assert_close(runs["zero_resumed"]["cache_end"], zero["cache_end"], atol=0, rtol=0)
    alone = runs["tp1_from_zero"]["figures"][0]
    assert alone["loss"] == pytest.approx(second["loss"], rel=1e-4, abs=1e-6)
    assert alone["grad_norm"] == pytest.approx(second["grad_norm"], rel=1e-4)
    assert_same_weights(runs["tp1_from_zero"]["cache_end"], zero["cache_end"])


def test_under_top_p_the_gathered_logits_give_the_one_rank_figures(
    runs: dict[str, dict],
) -> None:
    one, two = runs["tp1_top_p"], runs["tp2_top_p"]
    # the nucleus is in effect: not the figures without it
    assert one["figures"][0]["entropy"] < runs["tp1"]["figures"][0]["entropy"] - 1e-3
    for a, b in zip(one["figures"], two["figures"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["entropy"] == pytest.approx(a["entropy"], rel=1e-4)
    assert_same_weights(two["cache_end"], one["cache_end"])
