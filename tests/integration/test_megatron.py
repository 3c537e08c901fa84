"""The Megatron-core backend on CPU (megatron-core 0.16.1 + the CPU-compat patches).

Slow tier: exact Megatron -> HF conversion (same logits), GRPO steps that
learn, and the time-sharing cycle under torchrun with 2 ranks (20 cycles: no
process group or Megatron parallel state left behind, RSS flat).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cluster import SCRIPTED_ENGINE

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

SMALL = {"vocab_size": 64, "layers": 1, "hidden": 64}


def test_megatron_weights_load_into_hf_llama_with_identical_logits() -> None:
    from rlix_async.models.tiny import tiny_llama
    from rlix_async.train.megatron import MegatronTrainer

    t = MegatronTrainer(seed=3)
    hf = tiny_llama(0).eval()
    hf.load_state_dict(t.weights_for_cache(), strict=True)
    ids = torch.tensor([[5, 17, 300, 2, 9]])
    t._parallel_state(None)
    try:
        with torch.no_grad():
            mg = t.forward_logits(t.model.eval(), ids)
    finally:
        t.destroy_group()
    assert torch.allclose(mg, hf(input_ids=ids).logits, atol=1e-5)


def test_megatron_grpo_steps_learn() -> None:
    from helpers.trainer import mass_below_8, sample_batch

    from rlix_async.config import ModelConfig, TrainConfig
    from rlix_async.models.tiny import tiny_llama
    from rlix_async.train.megatron import MegatronTrainer

    small = ModelConfig(**SMALL)
    t = MegatronTrainer(TrainConfig(lr=1e-2), small, seed=0)
    hf = tiny_llama(0, **SMALL).eval()  # samples and measures with the exported weights
    gen = torch.Generator().manual_seed(0)

    class View:  # sample_batch/mass_below_8 read `.model` as an HF model
        model = hf

    hf.load_state_dict(t.weights_for_cache())
    before = mass_below_8(View)  # type: ignore[arg-type]
    for _ in range(8):
        t.train_step(sample_batch(View, gen))  # type: ignore[arg-type]
        hf.load_state_dict(t.weights_for_cache())
    assert mass_below_8(View) > 2 * before  # type: ignore[arg-type]


@pytest.mark.timeout(400)
def test_twenty_megatron_cycles_under_torchrun(tmp_path: Path) -> None:
    from helpers.trainer import run_cycles

    run_cycles(tmp_path, "megatron", timeout=380)


@pytest.mark.timeout(300)
def test_a_pipeline_trains_with_the_megatron_backend_under_launch(tmp_path: Path) -> None:
    """Scripted shards (a test double; vLLM runs in tests/integration/test_demo.py), real everything else."""
    out = tmp_path / "out"
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        f"""
out: {out}
cluster: {{nodes: 1, gpus_per_node: 2}}
engine: {{kind: custom, custom: "{SCRIPTED_ENGINE}"}}
pipelines:
  - id: mg{abs(hash(str(tmp_path))) % 10000}
    steps: 2
    train: {{backend: megatron}}
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 4}}
    model: {{vocab_size: 1000, layers: 1, hidden: 64}}
    clusters:
      actor_train: {{tp: 1, devices: [0, 1]}}  # two torchrun ranks
      actor_infer: {{tp: 1, devices: [0, 1]}}
"""
    )
    run = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg)],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (metrics,) = out.glob("mg*/metrics.jsonl")
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
