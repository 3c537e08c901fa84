"""A pipeline killed -9 between two checkpoints: the trajectory ledger counts exactly what
the kill cost, and the demo's summary reports it.

`rlix-async launch` runs one pipeline (a real coordinator, torchrun trainer, router and
weight cache; shard workers on the scripted engine, as in test_launch.py) that saves a
checkpoint every 3 steps. Once step 4 is trained (the next checkpoint is due at step 6)
the test freezes the pipeline (SIGSTOP), reads what survives a kill (the newest
checkpoint: the steps in its weights and the groups in its buffer) and what the pipeline
had asked for, then kills it; the launcher resumes it from that checkpoint. Everything
asked for and not in the checkpoint is work done again: lost. The metrics' counters,
restored from the checkpoint, cannot see it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers.cluster import SCRIPTED_ENGINE
from helpers.ledger import kill_cost

from rlix_async.config import LaunchConfig, load_config
from rlix_async.demo import summarize
from rlix_async.rollout.ledger import LEDGER, read_events, tally
from rlix_async.train.checkpoints import latest_checkpoint

pytest.importorskip("transformers")

STEPS, GROUPS, SIZE, EVERY = 6, 2, 2, 3
BATCH = GROUPS * SIZE  # trajectories trained per step
CONFIG = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 2}}
engine: {{kind: custom, custom: "{engine}", custom_args: {{token_delay_s: 0.05}}}}
pipelines:
  - id: {pid}
    steps: {steps}
    checkpoint_every: {every}       # steps 3 and 6: a kill after step 4 rolls it back
    # one group at a time, 0.2 s each: steps come 0.4 s apart (a strike lands between
    # checkpoints), groups finish in the order they started and none goes stale
    max_trajectory_age_steps: 1
    rollout: {{groups_per_step: {groups}, group_size: {size}, max_tokens: 4, max_groups_in_flight: 1}}
    model: {{vocab_size: 1000, layers: 1, hidden: 64}}
    clusters:
      actor_train: {{tp: 1, devices: [0]}}
      actor_infer: {{tp: 1, devices: [0, 1]}}
"""


def _steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    if not path.exists():
        return 0
    return max((json.loads(x)["step"] for x in path.read_text().splitlines() if x), default=0)


def _pids(pattern: str) -> list[int]:
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


@pytest.mark.timeout(240)
def test_a_kill_between_checkpoints_is_counted_as_lost_exactly(tmp_path: Path) -> None:
    pid = f"k{os.getpid() % 10000}"
    out = tmp_path / "out"
    cfg_path = tmp_path / "pipelines.yaml"
    cfg_path.write_text(
        CONFIG.format(
            out=out,
            pid=pid,
            engine=SCRIPTED_ENGINE,
            steps=STEPS,
            groups=GROUPS,
            size=SIZE,
            every=EVERY,
        )
    )
    run = out / pid
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 150
        while _steps(run) < 1:
            assert proc.poll() is None, "the launch ended before its first step"
            assert time.monotonic() < deadline, "no training step"
            time.sleep(0.1)
        # torchrun and its rank, found before the strike: a step takes a fraction of a
        # second, and the freeze must land before step 6's checkpoint
        ranks = _pids(f"rlix_async.pipeline --config {run}/pipeline.yaml")
        assert len(ranks) == 2
        while _steps(run) < EVERY + 1:
            assert proc.poll() is None, "the launch ended before the strike"
            assert time.monotonic() < deadline, f"no step {EVERY + 1}"
            time.sleep(0.005)
        for p in sorted(ranks, reverse=True):  # frozen (the rank first): nothing it
            os.kill(p, signal.SIGSTOP)  # writes from here on can count
        trained_at_kill = _steps(run)
        ckpt = latest_checkpoint(run / "ckpt")
        assert ckpt is not None
        saved_step = int(ckpt.stem.split("_")[1])
        saved = torch.load(ckpt, weights_only=True)
        in_saved_buffer = sum(len(g["responses"]) for g in saved["buffer"]["groups"])
        events = list(read_events(run / LEDGER))
        requested = sum(e["n"] for e in events if e["ev"] == "requested")
        # nothing dropped, failed or stopped so far: every trajectory asked for is either
        # in the checkpoint (trained into its weights, or in its buffer) or lost
        assert not [e for e in events if e["ev"] == "dropped"]
        assert {(e["failed"], e["cancelled"]) for e in events if e["ev"] == "finished"} <= {(0, 0)}
        cost = requested - saved_step * BATCH - in_saved_buffer
        assert kill_cost(run) == cost  # the helper the demo's kill test uses agrees
        for p in ranks:
            os.kill(p, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 0, stdout[-3000:]
    assert trained_at_kill > saved_step == EVERY  # step 4 was trained, then rolled back
    log = (out / "logs" / f"pipeline-{pid}.log").read_text()
    assert f"resumed from {ckpt} (step {saved_step})" in log

    t = tally(run / LEDGER)
    assert t.restarts == 1
    # the rolled-back step's batch at least, and the groups buffered or in flight after it
    assert cost >= (trained_at_kill - saved_step) * BATCH > 0
    assert t.lost_to_restarts == t.lost == cost
    assert t.trained == STEPS * BATCH  # every step once, in the history that survived
    assert t.pending == 0
    assert t.requested == (t.trained + t.dropped_stale + t.cancelled_stale + t.left_over + t.lost)
    summary = summarize(load_config(cfg_path, LaunchConfig), 0.0)
    assert summary["lost_trajectories"] == cost
    row = summary["pipelines"][pid]
    assert row["trajectories_lost_to_restarts"] == cost and row["trajectories_unaccounted"] == 0
    assert row["restarts"] == 1 and row["steps"] == STEPS
