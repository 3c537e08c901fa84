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
from helpers.trainer import megatron_logits

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow

SMALL = {"vocab_size": 64, "layers": 1, "hidden": 64}


@pytest.mark.beside_heavy  # torchrun or in-process: no heartbeats
def test_megatron_weights_load_into_hf_llama_with_identical_logits() -> None:
    from rlix_async.models.tiny import tiny_llama
    from rlix_async.train.megatron import MegatronTrainer

    t = MegatronTrainer(seed=3)
    hf = tiny_llama(0).eval()
    hf.load_state_dict(t.weights_for_cache(), strict=True)
    ids = torch.tensor([[5, 17, 300, 2, 9]])
    mg = megatron_logits(t, ids)
    assert torch.allclose(mg, hf(input_ids=ids).logits, atol=1e-5)


@pytest.mark.beside_heavy  # torchrun or in-process: no heartbeats
@pytest.mark.parametrize("tied", [True, False])
def test_megatron_loads_an_hf_llama_directory_with_identical_logits(
    tmp_path: Path, tied: bool
) -> None:
    """Grouped-query attention (2 heads, 1 kv group), RoPE and norms as HF computes them;
    the cache gets the directory's weights back unchanged."""
    import transformers
    from helpers.tiny_text import save_tiny_model

    from rlix_async.config import LossConfig, MegatronTrainConfig, ModelConfig
    from rlix_async.train.megatron import MegatronTrainer

    path = save_tiny_model(tmp_path / "m", "llama", seed=4, tie_word_embeddings=tied)
    # not Megatron's defaults, so a shape that ignored the directory's would show
    c = transformers.AutoConfig.from_pretrained(path)
    if getattr(c, "rope_parameters", None):
        c.rope_parameters["rope_theta"] = 50000.0
    else:
        c.rope_theta = 50000.0
    c.rms_norm_eps = 1e-2
    c.save_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # with a KL reference: a second model holding the directory's weights too
    cfg = MegatronTrainConfig(loss=LossConfig(kl_coef=0.1))
    t = MegatronTrainer(cfg, ModelConfig(path=str(path)), seed=0)
    assert t.reference is not None
    for name, p in t.model.state_dict().items():
        assert p is None or torch.equal(t.reference.state_dict()[name], p), name
    expected = hf.state_dict()
    if tied:
        expected.pop("lm_head.weight")  # the receiver ties it again (shards/vllm/transfer.py)
    cache = t.weights_for_cache()
    assert cache.keys() == expected.keys()
    assert all(torch.equal(cache[k], v) for k, v in expected.items())
    ids = torch.tensor([[5, 17, 30, 2, 9, 44]])
    mg = megatron_logits(t, ids)
    assert torch.allclose(mg, hf(input_ids=ids).logits, atol=1e-5)


@pytest.mark.beside_heavy  # torchrun or in-process: no heartbeats
def test_megatron_refuses_a_model_family_it_would_build_wrong(tmp_path: Path) -> None:
    from helpers.tiny_text import save_tiny_model

    from rlix_async.train.megatron_hf import MegatronModelError, model_shape

    path = save_tiny_model(tmp_path / "q", "qwen2")
    with pytest.raises(MegatronModelError, match=r"Llama-family checkpoints .* not qwen2"):
        model_shape(str(path))


@pytest.mark.beside_heavy  # torchrun or in-process: no heartbeats
def test_megatron_grpo_steps_learn() -> None:
    from helpers.trainer import mass_below_8, sample_batch

    from rlix_async.config import MegatronTrainConfig, ModelConfig
    from rlix_async.models.tiny import tiny_llama
    from rlix_async.train.megatron import MegatronTrainer

    small = ModelConfig(**SMALL)
    t = MegatronTrainer(MegatronTrainConfig(lr=1e-2), small, seed=0)
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


@pytest.mark.beside_heavy  # torchrun or in-process: no heartbeats
def test_the_megatron_reference_stays_at_the_start_and_the_kl_grows() -> None:
    from helpers.trainer import sample_batch

    from rlix_async.config import LossConfig, MegatronTrainConfig, ModelConfig
    from rlix_async.models.tiny import tiny_llama
    from rlix_async.train.megatron import MegatronTrainer

    cfg = MegatronTrainConfig(lr=1e-2, minibatches=1, loss=LossConfig(kl_coef=0.1))
    t = MegatronTrainer(cfg, ModelConfig(**SMALL), seed=0)
    assert t.reference is not None

    class View:  # sample_batch reads `.model` as an HF model
        model = tiny_llama(0, **SMALL).eval()

    View.model.load_state_dict(t.weights_for_cache())
    batch = sample_batch(View, torch.Generator().manual_seed(0))  # type: ignore[arg-type]
    start = {k: v.clone() for k, v in t.model.state_dict().items() if v is not None}
    first = t.train_step(batch)
    assert first["kl"] == 0.0  # the policy is the reference before its first update
    second = t.train_step(batch)
    assert second["kl"] > 0.0
    for name, p in t.reference.state_dict().items():
        assert p is None or torch.equal(p, start[name]), name
    assert not all(torch.equal(t.model.state_dict()[n], v) for n, v in start.items())


@pytest.mark.beside_heavy  # torchrun or in-process: no heartbeats
@pytest.mark.timeout(400)
def test_twenty_megatron_cycles_under_torchrun(tmp_path: Path) -> None:
    from helpers.trainer import run_cycles

    run_cycles(tmp_path, "megatron", timeout=380)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("tp", "pp", "devices", "hidden", "zero"),
    [
        (1, 1, [0, 1], 64, True),  # data parallel 2, the optimizer state sharded over it
        (2, 1, [0, 1, 2, 3], 128, False),  # tensor parallel 2 x dp 2
        (2, 2, [0, 1, 2, 3], 128, False),  # tensor parallel 2 x pipeline parallel 2
    ],
)
def test_a_pipeline_trains_with_the_megatron_backend_under_launch(
    tmp_path: Path, tp: int, pp: int, devices: list[int], hidden: int, zero: bool
) -> None:
    """Scripted shards (a test double; vLLM runs in tests/integration/test_demo.py), real
    everything else: one torchrun rank per device, ``tp`` x ``pp`` consecutive ranks a
    replica (``zero``: the distributed optimizer). The last step's checkpoint exports
    to an HF directory transformers loads."""
    out = tmp_path / "out"
    cfg = tmp_path / "p.yaml"
    cfg.write_text(
        f"""
out: {out}
cluster: {{nodes: 1, gpus_per_node: {len(devices)}}}
engine: {{kind: custom, custom: "{SCRIPTED_ENGINE}"}}
pipelines:
  - id: mg{abs(hash(str(tmp_path))) % 10000}
    steps: 2
    train: {{backend: megatron, distributed_optimizer: {str(zero).lower()}}}
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 4}}
    model: {{vocab_size: 999, layers: {pp}, hidden: {hidden}}}
    clusters:
      actor_train: {{tp: {tp}, pp: {pp}, devices: {devices}}}
      actor_infer: {{tp: 1, devices: {devices}}}
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
    (ckpt,) = metrics.parent.glob("ckpt/step_2*")
    # sharded: every rank of the first replica wrote its own part, and with the
    # distributed optimizer the other replica's ranks their share of its state
    parts = sorted(p.name for p in ckpt.glob("part-*"))
    if zero:
        assert parts == ["part-pp0-tp0-dp1.safetensors", "part-pp0-tp0.safetensors"]
    else:
        assert parts == [f"part-pp{s}-tp{t}.safetensors" for s in range(pp) for t in range(tp)]
    hf = tmp_path / "hf"
    done = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "export", str(ckpt), "--hf", str(hf)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.vocab_size == 999 and model.config.num_attention_heads == hidden // 64
    assert model.config.num_hidden_layers == pp
