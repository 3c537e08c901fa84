"""The torch trainer: GRPO steps raise the rewarded tokens' probability; checkpoints round-trip;
offload/group cycles under torchrun leak neither memory nor process groups."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers.trainer import mass_below_8, run_cycles, sample_batch

from rlix_async.config import ModelConfig, TrainConfig
from rlix_async.train.trainer import TorchTrainer, latest_checkpoint

SMALL = ModelConfig(vocab_size=64, layers=1, hidden=64)


def test_grpo_steps_raise_the_rewarded_tokens_probability() -> None:
    trainer = TorchTrainer(TrainConfig(lr=1e-2), SMALL, seed=0)
    gen = torch.Generator().manual_seed(0)
    before = mass_below_8(trainer)
    for _ in range(8):
        stats = trainer.train_step(sample_batch(trainer, gen))
        assert stats["is_weight_mean"] == pytest.approx(1.0, abs=0.05)  # on-policy here
    assert mass_below_8(trainer) > 2 * before


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    a = TorchTrainer(model=SMALL, seed=0)
    a.train_step(sample_batch(a, torch.Generator().manual_seed(1)))
    a.save(tmp_path / "step_1.pt", {"extra": 7})
    b = TorchTrainer(model=SMALL, seed=5)
    ckpt = b.load(latest_checkpoint(tmp_path))  # type: ignore[arg-type]
    assert ckpt["extra"] == 7 and b.step == 1
    for (k, va), (_, vb) in zip(
        a.model.state_dict().items(), b.model.state_dict().items(), strict=True
    ):
        assert torch.equal(va, vb), k
    assert latest_checkpoint(tmp_path / "none") is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_twenty_offload_cycles_under_torchrun_leak_nothing(tmp_path: Path) -> None:
    run_cycles(tmp_path, "torch")
