"""Multi-node for real, on one machine: three hosts in network namespaces
(tests/helpers/hosts.py), each running ``rlix-async launch --node K`` exactly as a
user runs it on each machine of a cluster.

Host 0 runs the coordinator (tcp, CURVE keys from ``rlix-async keygen``); hosts 1
and 2 run vLLM shard workers and trainers, placed so that each pipeline's weights
cross hosts: ``near`` trains on host 1 and rolls out on host 1 (shared memory) and
host 2 (pulled over tcp from its trainer's weight server, with the shard's own key);
``far`` trains on host 2 and rolls out only on host 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.hosts import Hosts, make_hosts

pytest.importorskip("vllm")
pytestmark = [pytest.mark.multinode, pytest.mark.vllm]

CONFIG = """
out: {out}
cluster: {{nodes: 3, gpus_per_node: 2}}
engine: {{kind: vllm, kv_cache_mb: 16, max_model_len: 64}}
pipelines:
  - id: near
    seed: 1
    steps: {steps}
    task: {{name: target_tokens, lo: 0, hi: 32}}
    rollout: {{groups_per_step: 2, group_size: 4, max_tokens: 6}}
    model: {{path: {model}}}
    clusters:
      actor_train: {{tp: 1, devices: [2]}}      # host 1
      actor_infer: {{tp: 1, devices: [3, 4]}}   # host 1 and host 2
  - id: far
    seed: 2
    steps: {steps}
    task: {{name: target_tokens, lo: 256, hi: 288}}
    rollout: {{groups_per_step: 2, group_size: 4, max_tokens: 6}}
    model: {{path: {model}}}
    clusters:
      actor_train: {{tp: 1, devices: [5]}}      # host 2
      actor_infer: {{tp: 1, devices: [3]}}      # host 1: every sync crosses hosts
"""

CLI = [sys.executable, "-m", "rlix_async.cli"]


def _setup(tmp_path: Path, steps: int) -> tuple[Path, Path, Path]:
    from rlix_async.models.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", seed=0, vocab_size=512, layers=1, hidden=64)
    keys = tmp_path / "keys"
    subprocess.run([*CLI, "keygen", str(keys)], check=True, capture_output=True, timeout=60)
    out = tmp_path / "out"
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(CONFIG.format(out=out, steps=steps, model=model))
    return cfg, out, keys


def _launch(hosts: Hosts, k: int, cfg: Path, keys: Path, job: str, *extra: str) -> None:
    argv = [
        *CLI, "launch", str(cfg), "--node", str(k),
        "--coordinator", f"tcp://{hosts[0].address}:7611",
        "--address", hosts[k].address, "--keys", str(keys), "--job", job, *extra,
    ]  # fmt: skip
    hosts.start(hosts[k], argv, cfg.parent / f"launch-{k}.log")


def _metrics(out: Path, pid: str) -> list[dict[str, object]]:
    path = out / pid / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _logs(tmp_path: Path) -> str:
    parts = []
    for path in sorted([*tmp_path.glob("launch-*.log"), *(tmp_path / "out" / "logs").glob("*")]):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)


@pytest.mark.timeout(600)
def test_two_pipelines_train_across_three_hosts(tmp_path: Path) -> None:
    cfg, out, keys = _setup(tmp_path, steps=3)
    with make_hosts(3, tmp_path / "hosts") as hosts:
        for k in range(3):
            _launch(hosts, k, cfg, keys, "mn1")
        deadline = time.monotonic() + 540
        while time.monotonic() < deadline:
            codes = [proc.poll() for _, proc, _ in hosts.procs]
            if all(c is not None for c in codes):
                break
            time.sleep(2)
        codes = [proc.poll() for _, proc, _ in hosts.procs]
        assert codes == [0, 0, 0], _logs(tmp_path)
    for pid in ("near", "far"):
        rows = _metrics(out, pid)
        assert [r["step"] for r in rows] == [1, 2, 3], _logs(tmp_path)
    logs = out / "logs"
    # near's second shard and far's only shard are on the other host: their versions
    # came over tcp from the trainer's weight server, never from shared memory
    assert "serving weights at tcp://" in (logs / "pipeline-near.log").read_text()
    assert "serving weights at tcp://" in (logs / "pipeline-far.log").read_text()
    journal = [json.loads(x) for x in (out / "journal.jsonl").read_text().splitlines()]
    joined = {(e["pipeline"], e["rank"]): e["incarnation"].split(":")[0] for e in journal
              if e["ev"] == "shard_joined"}  # fmt: skip
    assert joined == {("near", 0): "host1", ("near", 1): "host2", ("far", 0): "host1"}
    synced = {(e["pipeline"], e["rank"], e["version"]) for e in journal if e["ev"] == "synced"}
    assert any(p == "far" and v >= 1 for p, _, v in synced), sorted(synced)
    assert any(p == "near" and r == 1 and v >= 1 for p, r, v in synced), sorted(synced)
