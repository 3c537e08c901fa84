"""The quick demo end to end: `rlix-async demo --quick` with real vLLM shards and torchrun
trainers, the coordinator killed -9 and a pipeline killed -9 mid-run.

The launcher restarts the coordinator on its journal and the pipeline with
--resume from its newest checkpoint; the demo must still finish with rising
rewards, and report from the trajectory ledger exactly what each kill cost: nothing
for the coordinator's, and for the pipeline's what it had done since its newest
checkpoint (worked out while it is stopped, just before the kill). The demo exits 1
when anything was lost.
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
from helpers.ledger import kill_cost

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def _pids(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _steps(out: Path, pid: str) -> int:
    path = out / pid / "metrics.jsonl"
    if not path.exists():
        return 0
    return max(
        (json.loads(line)["step"] for line in path.read_text().splitlines() if line), default=0
    )


@pytest.mark.timeout(1500)
def test_demo_survives_coordinator_and_pipeline_kills(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlix_async.cli", "demo", "--quick", "--out", str(out), "--steps", "12"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Steps take 1-5 s once running: watch both pipelines and strike each as soon as
        # it gets there (the coordinator once band-high has 3 steps, band-low at 4).
        done_before_kill = 0
        cost = -1
        coordinator_killed = False
        deadline = time.monotonic() + 900
        while not (coordinator_killed and done_before_kill):
            assert proc.poll() is None, "demo exited before both kills"
            assert time.monotonic() < deadline, "the pipelines did not reach their kill points"
            if not coordinator_killed and _steps(out, "band-high") >= 3:
                coord = _pids(f"coordinator --config {out}/coordinator.yaml")
                assert len(coord) == 1
                os.kill(coord[0], signal.SIGKILL)
                coordinator_killed = True
            if not done_before_kill and _steps(out, "band-low") >= 4:
                trainer = _pids(f"rlix_async.pipeline --config {out}/band-low/pipeline.yaml")
                assert len(trainer) == 3  # the torchrun agent and its two ranks
                for pid in trainer:  # stopped: what it has done so far is fixed
                    os.kill(pid, signal.SIGSTOP)
                done_before_kill = _steps(out, "band-low")
                cost = kill_cost(out / "band-low")
                for pid in trainer:
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        stdout, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = json.loads((out / "summary.json").read_text())
    low, high = summary["pipelines"]["band-low"], summary["pipelines"]["band-high"]
    # the coordinator's kill cost nothing; the pipeline's, exactly its work since its
    # newest checkpoint (the groups it had in flight, usually, and finished since)
    assert (high["trajectories_lost"], high["restarts"]) == (0, 0), high
    assert (low["trajectories_lost_to_restarts"], low["restarts"]) == (cost, 1), (cost, low)
    assert low["trajectories_failed"] == low["trajectories_discarded"] == 0, low
    assert summary["lost_trajectories"] == cost
    assert proc.returncode == (1 if cost else 0), stdout[-4000:]  # lost work fails the demo
    assert f"lost trajectories {cost}" in stdout
    for pid, p in summary["pipelines"].items():
        assert p["trajectories_unaccounted"] == p["trajectories_pending"] == 0, (pid, p)
        assert p["steps"] == 12, pid
        assert p["reward_last"] >= 0.8 or p["reward_last"] >= 3 * p["reward_first"], (pid, p)
        assert p["shrinks"] > 0 and p["expands"] > 0 and p["weight_syncs"] > 0, (pid, p)
    log = (out / "logs" / "pipeline-band-low.log").read_text()
    assert "resumed from" in log  # the restarted pipeline continued from its checkpoint
    assert done_before_kill >= 4
    for name in ("journal.jsonl", "timeline.png", "reward.png"):
        assert (out / name).stat().st_size > 0
    assert not _pids(str(out))  # no orphan process
    assert not list(Path("/dev/shm").glob("rlix-*-band-*"))  # no leftover shared memory
