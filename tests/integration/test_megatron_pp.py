"""The Megatron trainer at pipeline parallel 2 (alone, with data parallel 2 and with
tensor parallel 2) against one rank, under torchrun on this CPU (gloo, Megatron's 1F1B
schedule): the same HF weights load into every layout; the weight cache gathered from
the stages is the same bytes; logits, each step's loss and gradient norm agree; the
tied embedding's two copies (first and last stage) stay one weight; a checkpoint
written at pp=2 resumes exactly at pp=2 and, resharded, at pp=1 and from tp2 x pp2 at
tp=1. Each step has two minibatches of several micro-batches (tests/helpers/
megatron_batches.py), so the schedule interleaves forward and backward passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.megatron_tp_runs import assert_same_training, assert_same_weights, run_jobs

pytest.importorskip("megatron.core")
# the module's runs (torchrun jobs of 1-4 ranks on 2 cores, beside the other pytest
# worker) are set up by the first test: several minutes under CI's load
pytestmark = [pytest.mark.timeout(600), pytest.mark.xdist_group("megatron_pp")]  # one fixture

SHAPE = {"vocab_size": 63, "layers": 2, "hidden": 128}  # 2 heads, 2 query groups


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from rlix_async.models.tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("pp")
    model = save_tiny_llama(root / "model", seed=3, **SHAPE)
    tied = save_tiny_llama(root / "tied", seed=4, tied=True, **SHAPE)
    pp2 = root / "pp2" / "ckpt_1"
    out = run_jobs(root, 1, {
        "tp1": {"model": model, "tp": 1, "steps": 2},
        "tied_tp1": {"model": tied, "tp": 1, "steps": 2},
    })  # fmt: skip
    out |= run_jobs(root, 2, {
        "pp2": {"model": model, "tp": 1, "pp": 2, "steps": 2},
        "tied_dp2": {"model": tied, "tp": 1, "steps": 2},
        "pp2_resumed": {"model": model, "tp": 1, "pp": 2, "steps": 1, "ckpt": pp2},
    })  # fmt: skip
    out |= run_jobs(root, 4, {
        "tied_pp2_dp2": {"model": tied, "tp": 1, "pp": 2, "steps": 2},
        "tied_tp2_pp2": {"model": tied, "tp": 2, "pp": 2, "steps": 2},
        # tied at pp=2: the last stage's copy of the embedding and its state, from stage 0's
        "tied_pp2_resumed": {
            "model": tied, "tp": 1, "pp": 2, "steps": 1, "ckpt": root / "tied_pp2_dp2" / "ckpt_1"
        },
    })  # fmt: skip
    out |= run_jobs(root, 1, {
        "tp1_from_pp2": {"model": model, "tp": 1, "steps": 1, "ckpt": pp2},
        "tied_tp1_from_tp2_pp2": {
            "model": tied, "tp": 1, "steps": 1, "ckpt": root / "tied_tp2_pp2" / "ckpt_1"
        },
    })  # fmt: skip
    return out


def test_pp2_trains_as_one_rank(runs: dict[str, dict]) -> None:
    assert runs["tp1"]["logits"].shape == (1, 6, 63)
    assert_same_training(runs["tp1"], runs["pp2"], clip_frac=True)


def test_every_step_the_layers_use_that_steps_groups(runs: dict[str, dict]) -> None:
    """Megatron's modules keep the process groups they were built with; the per-step
    groups replace them (else the layers would talk over the constructor's gloo
    group, destroyed, in place of each step's NCCL one)."""
    for name in ("tp1", "pp2", "tied_tp2_pp2"):
        assert runs[name]["stale_groups"] == [0, 0], name


def test_tied_embeddings_on_two_stages_stay_one_weight(runs: dict[str, dict]) -> None:
    """The embedding (first stage) and the output layer's copy of it (last stage) get
    the same summed gradient and the same update: the cache holds it once and it equals
    one rank's, at pp2 with two replicas and at tp2 x pp2."""
    assert "lm_head.weight" not in runs["tied_tp1"]["cache_end"]
    assert_same_training(runs["tied_dp2"], runs["tied_pp2_dp2"], clip_frac=True)
    assert_same_training(runs["tied_tp1"], runs["tied_tp2_pp2"], clip_frac=True)


def test_a_tied_pp2_checkpoint_resumes_exactly(runs: dict[str, dict]) -> None:
    second = runs["tied_pp2_dp2"]["figures"][1]
    assert runs["tied_pp2_resumed"]["figures"][0] == second  # bit for bit
    torch.testing.assert_close(
        runs["tied_pp2_resumed"]["cache_end"], runs["tied_pp2_dp2"]["cache_end"], atol=0, rtol=0
    )


def test_a_pp2_checkpoint_resumes_exactly_at_pp2_and_resharded(runs: dict[str, dict]) -> None:
    second = runs["pp2"]["figures"][1]
    assert runs["pp2_resumed"]["figures"][0] == second  # bit for bit: the same layout
    torch.testing.assert_close(
        runs["pp2_resumed"]["cache_end"], runs["pp2"]["cache_end"], atol=0, rtol=0
    )
    for resumed, run in (
        ("tp1_from_pp2", "pp2"),
        ("tied_tp1_from_tp2_pp2", "tied_tp2_pp2"),
    ):
        first = runs[resumed]["figures"][0]
        want = runs[run]["figures"][1]
        assert first["loss"] == pytest.approx(want["loss"], rel=1e-4, abs=1e-6)
        assert first["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-4)
        # the second minibatch's update used the resharded moments: the weights agree
        assert_same_weights(runs[resumed]["cache_end"], runs[run]["cache_end"])


def test_twenty_cycles_at_pipeline_parallel_2_leak_nothing(tmp_path: Path) -> None:
    """Per step: the parallel state, the 1F1B schedule's groups and the embedding group
    built and destroyed, the stages gathered onto rank 0; RSS flat after warm-up on
    both ranks (tests/helpers/trainer.py)."""
    from helpers.trainer import run_cycles

    rows = run_cycles(tmp_path, "megatron_pp2", timeout=380)
    assert rows[0]["weights"] and not rows[1]["weights"]
