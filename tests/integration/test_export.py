"""`rlix-async export CKPT --hf DIR`: a pipeline checkpoint becomes a Hugging Face directory
that transformers loads with the trained weights, the tokenizer and the chat template.
Real files, the real CLI in a child process; a tiny random model (no hub here)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny_text import save_tiny_model

transformers = pytest.importorskip("transformers")

from rlix_async.config import ModelConfig, TorchTrainConfig  # noqa: E402
from rlix_async.train.trainer import TorchTrainer  # noqa: E402

PIPELINE = """
id: exp
model: {{path: {model}}}
clusters:
  actor_train: {{tp: 1, devices: [0]}}
  actor_infer: {{tp: 1, devices: [0]}}
"""


def export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "export", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(180)
def test_a_checkpoint_exports_as_a_model_directory(tmp_path: Path) -> None:
    base = save_tiny_model(tmp_path / "base", "qwen2", seed=0)
    run = tmp_path / "out" / "exp"
    run.mkdir(parents=True)
    (run / "pipeline.yaml").write_text(PIPELINE.format(model=base))
    trainer = TorchTrainer(TorchTrainConfig(dtype="float32"), ModelConfig(path=str(base)))
    with torch.no_grad():  # "training": the exported weights must be these, not the base's
        for p in trainer.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ckpt = run / "ckpt" / "step_3.pt"
    trainer.save(ckpt, {})

    done = export(str(ckpt), "--hf", str(tmp_path / "hf"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(tmp_path / "hf")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    trained = trainer.model.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, trained[name]), name
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tok.chat_template and tok.eos_token == "<|im_end|>"
    ids = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, trainer.model(ids).logits)

    # bad input: one line, exit 2, nothing overwritten
    again = export(str(ckpt), "--hf", str(tmp_path / "hf"))
    assert again.returncode == 2 and "already holds a model" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1
    gone = export(str(run / "ckpt" / "step_9.pt"), "--hf", str(tmp_path / "hf2"))
    assert gone.returncode == 2 and "no such checkpoint" in gone.stderr
    (run / "ckpt" / "step_4.pt").write_bytes(b"not a checkpoint")
    torn = export(str(run / "ckpt" / "step_4.pt"), "--hf", str(tmp_path / "hf3"))
    assert torn.returncode == 2 and "not a pipeline checkpoint" in torn.stderr
    assert not (tmp_path / "hf3").exists()
