"""The Megatron trainer at expert parallel 2 (alone, and with pipeline parallel 2)
against data parallel 2, under torchrun on this CPU (gloo, Megatron's all-to-all
token dispatcher) on a tiny Qwen3-MoE (4 experts, top 2): the same HF weights load
into every layout, each rank reading its own experts; the weight cache gathered from
the expert-parallel ranks is the same bytes, every expert under its HF name; each
step's loss and gradient norm agree (expert gradients averaged with their own
replicas only, over every replica's tokens; the norm over the expert group); shares
that differ by a row run as many passes (no rank waits forever on the all-to-all);
checkpoints written at ep 2 and pp 2 x ep 2 resume exactly, and at ep 1 (resharded),
and a one-rank checkpoint resumes at ep 2."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.megatron_tp_runs import assert_same_training, assert_same_weights, run_jobs
from helpers.tiny_text import save_tiny_model

pytest.importorskip("megatron.core")
# one worker runs the module: its runs are a module fixture (on two, both would make it)
pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.slow,
    pytest.mark.beside_heavy,
    pytest.mark.xdist_group("megatron_ep"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    root = tmp_path_factory.mktemp("ep")
    moe = save_tiny_model(root / "model", "qwen3_moe", seed=3, tie_word_embeddings=False)
    tied = save_tiny_model(root / "tied", "qwen3_moe", seed=4)  # the output layer: the embedding
    # a row a micro-batch over 7 rows: the replicas' passes differ in number
    odd = {"model": moe, "tp": 1, "steps": 2, "batches": "odd", "micro_batch_size": 1}
    out = run_jobs(root, 1, {"tp1": {"model": moe, "tp": 1, "steps": 2}})
    out |= run_jobs(root, 2, {
        "dp2": {"model": moe, "tp": 1, "steps": 2},
        "ep2": {"model": moe, "tp": 1, "ep": 2, "steps": 2},
        "pp2": {"model": moe, "tp": 1, "pp": 2, "steps": 2},
        "dp2_odd": odd,
        "dp2_routes": {"model": moe, "tp": 1, "steps": 2, "batches": "routes"},
        "tied_dp2": {"model": tied, "tp": 1, "steps": 2},
        "ep2_routes": {"model": moe, "tp": 1, "ep": 2, "steps": 2, "batches": "routes"},
        "ep2_odd": {**odd, "ep": 2},
        "ep2_resumed": {"model": moe, "tp": 1, "ep": 2, "steps": 1, "ckpt": root / "ep2" / "ckpt_1"},
        "ep2_from_dp2": {"model": moe, "tp": 1, "ep": 2, "steps": 1, "ckpt": root / "dp2" / "ckpt_1.pt"},
        "dp2_from_ep2": {"model": moe, "tp": 1, "steps": 1, "ckpt": root / "ep2" / "ckpt_1"},
    })  # fmt: skip
    out |= run_jobs(root, 4, {
        "pp2_ep2": {"model": moe, "tp": 1, "pp": 2, "ep": 2, "steps": 2},
        "pp2_ep2_routes": {"model": moe, "tp": 1, "pp": 2, "ep": 2, "steps": 2, "batches": "routes"},
        # two replicas of each expert (expert data parallel 2)
        "dp4": {"model": moe, "tp": 1, "steps": 2},
        "ep2_dp4": {"model": moe, "tp": 1, "ep": 2, "steps": 2},
        # the tied embedding's copies on the first and the last stage
        "tied_pp2_ep2": {"model": tied, "tp": 1, "pp": 2, "ep": 2, "steps": 2},
    })  # fmt: skip
    pp2_ep2 = root / "pp2_ep2" / "ckpt_1"
    out |= run_jobs(
        root, 2, {"dp2_from_pp2_ep2": {"model": moe, "tp": 1, "steps": 1, "ckpt": pp2_ep2}}
    )
    return out | run_jobs(root, 1, {"tp1_from_pp2_ep2": {"model": moe, "tp": 1, "steps": 1, "ckpt": pp2_ep2}})  # fmt: skip


def test_the_cache_holds_every_expert_under_its_hf_name(runs: dict[str, dict]) -> None:
    cache = runs["ep2"]["cache_start"]
    for layer in (0, 1):
        for e in range(4):
            for w in ("gate", "up", "down"):
                assert f"model.layers.{layer}.mlp.experts.{e}.{w}_proj.weight" in cache
    assert not any("local_experts" in k for k in cache)
    for name in ("tp1", "pp2", "pp2_ep2"):
        assert runs[name]["cache_start"].keys() == cache.keys(), name
        for k, v in cache.items():
            assert torch.equal(runs[name]["cache_start"][k], v), (name, k)


def test_ep2_trains_as_dp2(runs: dict[str, dict]) -> None:
    assert_same_training(runs["dp2"], runs["ep2"])


def test_pp2_x_ep2_trains_as_dp2(runs: dict[str, dict]) -> None:
    """Four ranks in Megatron's tp-ep-dp-pp order: stage s holds ranks 2s and 2s+1,
    each with two of the four experts of its layer (and pp 2 alone as one rank)."""
    assert_same_training(runs["tp1"], runs["pp2"])
    assert_same_training(runs["dp2"], runs["pp2_ep2"])


def test_rows_carry_each_layers_expert_load_over_every_rank(runs: dict[str, dict]) -> None:
    """The busiest expert's positions over the mean, per MoE layer, counted where each
    layer's router runs and summed over the ranks: the same at every layout that cuts
    the rows into the same pieces (padding positions are routed too)."""
    keys = {"moe/load_max_over_mean", "moe/load_min_over_mean"} | {
        f"moe/load_max_over_mean/layer_{n}" for n in (0, 1)
    }
    for pair in (("tp1", "pp2"), ("dp2", "ep2"), ("dp2", "pp2_ep2")):
        want, got = (runs[name]["figures"][0] for name in pair)
        assert keys <= want.keys(), want.keys()
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-9), (pair, k)
        # top 2 of 4 experts: between balanced (1) and two experts taking all (2)
        assert 1 <= want["moe/load_max_over_mean"] <= 2
        assert 0 <= want["moe/load_min_over_mean"] <= 1


def test_replayed_routes_train_alike_at_every_layout(runs: dict[str, dict]) -> None:
    """The batches carry engine routes (train/routing_replay.py): each rank's routers
    take its own rows' routes, each stage its own layers' columns, so the layouts
    train alike; the routes are not the model's own, so the step differs from the
    unreplayed one and agreement is partial (the same count at every layout)."""
    assert_same_training(runs["dp2_routes"], runs["ep2_routes"])
    assert_same_training(runs["dp2_routes"], runs["pp2_ep2_routes"])
    one, routed = runs["dp2"]["figures"][0], runs["dp2_routes"]["figures"][0]
    assert "routing_agreement" not in one
    assert 0 < routed["routing_agreement"] < 1
    assert routed["loss"] != pytest.approx(one["loss"], rel=1e-3)
    for name in ("ep2_routes", "pp2_ep2_routes"):
        got = runs[name]["figures"][0]["routing_agreement"]
        assert got == pytest.approx(routed["routing_agreement"], abs=1e-9), name


def test_experts_with_two_replicas_each_average_over_them(runs: dict[str, dict]) -> None:
    """ep 2 on four ranks: each expert on two replicas, its gradient summed over its
    own replicas (the expert-data-parallel group) and divided by all four."""
    assert_same_training(runs["dp4"], runs["ep2_dp4"])


def test_a_tied_embedding_at_pp2_x_ep2_trains_as_dp2(runs: dict[str, dict]) -> None:
    assert_same_training(runs["tied_dp2"], runs["tied_pp2_ep2"])


def test_uneven_shares_run_as_many_passes_and_train_as_dp2(runs: dict[str, dict]) -> None:
    assert_same_training(runs["dp2_odd"], runs["ep2_odd"])


def test_every_step_the_expert_layers_use_that_steps_groups(runs: dict[str, dict]) -> None:
    for name in ("ep2", "pp2", "pp2_ep2"):
        assert runs[name]["stale_groups"] == [0, 0], name


def test_checkpoints_resume_exactly_and_across_expert_parallel_sizes(
    runs: dict[str, dict],
) -> None:
    second = runs["ep2"]["figures"][1]
    assert runs["ep2_resumed"]["figures"][0] == second  # bit for bit: the same layout
    torch.testing.assert_close(
        runs["ep2_resumed"]["cache_end"], runs["ep2"]["cache_end"], atol=0, rtol=0
    )
    # at as many replicas (a step's figures are rank 0's share's): each expert's weights
    # and moments from the rank that held it
    for resumed, source in (
        ("dp2_from_ep2", "ep2"),
        ("dp2_from_pp2_ep2", "pp2_ep2"),
        ("ep2_from_dp2", "dp2"),  # a one-rank step_1.pt, its experts shared out
    ):
        figures, want = runs[resumed]["figures"][0], runs[source]["figures"][1]
        assert figures["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6), resumed
        assert figures["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4), resumed
        assert_same_weights(runs[resumed]["cache_end"], runs[source]["cache_end"])
    # one rank: the whole batch's update from the resharded state, the same weights
    assert_same_weights(runs["tp1_from_pp2_ep2"]["cache_end"], runs["pp2_ep2"]["cache_end"])


def test_twenty_cycles_at_expert_parallel_2_leak_nothing(tmp_path: Path) -> None:
    """Per step: the parallel state with its expert groups, the all-to-all dispatcher's
    groups rebound, the experts gathered onto rank 0; RSS flat after warm-up on both
    ranks (tests/helpers/trainer.py)."""
    from helpers.trainer import run_cycles

    moe = save_tiny_model(tmp_path / "model", "qwen3_moe", seed=3)
    rows = run_cycles(tmp_path, "megatron_ep2", timeout=380, model=str(moe))
    assert rows[0]["weights"] and not rows[1]["weights"]
    # the weights rank 0 publishes hold every expert, its own and rank 1's
    downs = [k for k in rows[0]["weights"] if k.endswith("down_proj.weight") and "experts" in k]
    assert len(downs) == 2 * 4
