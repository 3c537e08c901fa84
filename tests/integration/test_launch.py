"""`rlix-async launch`: coordinator, shard workers and torchrun pipelines, stopped cleanly.

Shard workers run the scripted engine (a test double loaded as a custom engine:
the fast tier cannot start vLLM engines; tests/integration/test_demo.py runs the
same launcher on vLLM). The coordinator, sockets, torchrun trainers, weight
cache and router are real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cluster import SCRIPTED_ENGINE

from rlix_async.rollout.ledger import LEDGER, tally

pytest.importorskip("transformers")

CONFIG = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 3}}
engine: {{kind: custom, custom: "{engine}"}}
pipelines:
  - id: {pid}-a
    steps: {steps}
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 4}}
    model: {{vocab_size: 1000, layers: 1, hidden: 64}}
    clusters:
      actor_train: {{tp: 1, devices: [0, 1]}}  # two torchrun ranks
      actor_infer: {{tp: 1, devices: [0, 1]}}
  - id: {pid}-b
    steps: {steps}
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 4}}
    model: {{vocab_size: 1000, layers: 1, hidden: 64}}
    clusters:
      actor_train: {{tp: 1, devices: [2]}}
      actor_infer: {{tp: 1, devices: [1, 2]}}
"""


def _write(tmp_path: Path, steps: int) -> tuple[Path, Path, str]:
    pid = f"l{os.getpid() % 10000}"
    out = tmp_path / "out"
    cfg = tmp_path / "pipelines.yaml"
    cfg.write_text(CONFIG.format(out=out, pid=pid, steps=steps, engine=SCRIPTED_ENGINE))
    return cfg, out, pid


def _no_leftovers(out: Path, pid: str) -> None:
    left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
    assert not left.split(), f"orphan processes: {left}"
    assert not list(Path("/dev/shm").glob(f"rlix-{os.getuid()}-{pid}-*"))


@pytest.mark.timeout(240)
def test_launch_runs_two_pipelines_to_the_end_and_leaves_nothing(tmp_path: Path) -> None:
    cfg, out, pid = _write(tmp_path, steps=3)
    run = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    for p in (f"{pid}-a", f"{pid}-b"):
        rows = [json.loads(x) for x in (out / p / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert rows[-1]["failed"] == 0
        # each step's estimate of itself alone was made (and sent): the row's train_s is
        # read after the report, so on a loaded host it can exceed the estimate's
        assert all(r["step_alone_s"] > 0 for r in rows), rows
        assert (out / p / "ckpt" / "step_3.pt").exists()
        # nothing lost, by the ledger: every step's batch (a's crossing to its second
        # rank as msgpack) trained, the rest left over when the steps were done
        t = tally(out / p / LEDGER)
        assert (t.lost, t.pending, t.restarts, t.trained) == (0, 0, 0, 3 * 2 * 2), t
        assert t.requested == t.trained + t.dropped_stale + t.cancelled_stale + t.left_over
    events = [json.loads(x)["ev"] for x in (out / "journal.jsonl").read_text().splitlines()]
    assert "shrink" in events and "expand" in events and "synced" in events
    _no_leftovers(out, pid)


@pytest.mark.timeout(240)
def test_sigterm_stops_every_process_and_removes_shared_memory(tmp_path: Path) -> None:
    cfg, out, pid = _write(tmp_path, steps=1000)
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not (out / f"{pid}-a" / "metrics.jsonl").exists():
        assert proc.poll() is None and time.monotonic() < deadline, "no training step"
        time.sleep(0.5)
    assert list(Path("/dev/shm").glob(f"rlix-{os.getuid()}-{pid}-*"))  # caches exist mid-run
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode == 130
    _no_leftovers(out, pid)
