"""The README's main job end to end: `rlix-async demo` with real vLLM shards and torchrun
trainers, the coordinator killed -9 and a pipeline killed -9 mid-run.

The launcher restarts the coordinator on its journal and the pipeline with
--resume from its newest checkpoint; the demo must still finish with rising
rewards and every trajectory accounted for.
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
        [sys.executable, "-m", "rlix_async.cli", "demo", "--out", str(out), "--steps", "12"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        # Steps take 1-5 s once running: watch both pipelines and strike each as soon as
        # it gets there (the coordinator once band-high has 3 steps, band-low at 4).
        done_before_kill = 0
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
                assert trainer
                done_before_kill = _steps(out, "band-low")
                for pid in trainer:  # the torchrun agent and its ranks
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
        stdout, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["lost_trajectories"] == 0
    for pid, p in summary["pipelines"].items():
        assert p["steps"] == 12, pid
        assert p["reward_last"] >= 0.8 or p["reward_last"] >= 3 * p["reward_first"], (pid, p)
        assert p["shrinks"] > 0 and p["expands"] > 0 and p["weight_syncs"] > 0, (pid, p)
    log = (out / "logs" / "pipeline-band-low.log").read_text()
    assert "resumed from" in log  # the restarted pipeline continued from its checkpoint
    assert done_before_kill >= 4
    for name in ("journal.jsonl", "timeline.png", "reward.png"):
        assert (out / name).stat().st_size > 0
    assert not _pids(str(out))  # no orphan process
    assert not list(Path("/dev/shm").glob("rlix-band-*"))  # no leftover shared memory
