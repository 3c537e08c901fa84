"""A real SLURM job: ``launchers/slurm/rlix.sbatch``, unchanged, on a one-node cluster.

``scripts/slurm-local.sh up`` installs Debian's slurm-wlm and munge when they are
missing (as root; CI's machines are Debian with root) and starts munged,
slurmctld and slurmd on 127.0.0.1. The test submits the template with only what a
user of this machine would give on the command line (one node, no GPUs, the
loopback interface) and a short two-pipeline config on vLLM shards, and asserts
the job completes with both pipelines' metrics.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytestmark = [pytest.mark.multinode, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
CONFIG = """
cluster: {{nodes: 1, gpus_per_node: 4}}
engine: {{kind: vllm, kv_cache_mb: 16, max_model_len: 64}}
pipelines:
  - id: left
    seed: 1
    steps: {steps}
    task: {{name: target_tokens, lo: 0, hi: 32}}
    rollout: {{groups_per_step: 2, group_size: 4, max_tokens: 6}}
    model: {{path: {model}}}
    clusters:
      actor_train: {{tp: 1, devices: [0]}}
      actor_infer: {{tp: 1, devices: [1]}}
  - id: right
    seed: 2
    steps: {steps}
    task: {{name: target_tokens, lo: 256, hi: 288}}
    rollout: {{groups_per_step: 2, group_size: 4, max_tokens: 6}}
    model: {{path: {model}}}
    clusters:
      actor_train: {{tp: 1, devices: [2]}}
      actor_infer: {{tp: 1, devices: [3]}}
"""


@pytest.fixture(scope="module")
def slurm() -> Iterator[None]:
    if os.geteuid() != 0:
        pytest.fail(
            "the SLURM test needs root (it installs and starts slurm-wlm and munge); "
            "deselect it with -m 'not multinode'"
        )
    up = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm-local.sh"), "up"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert up.returncode == 0, f"scripts/slurm-local.sh up failed:\n{up.stdout}{up.stderr}"
    try:
        yield
    finally:
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "slurm-local.sh"), "down"],
            capture_output=True, timeout=120,
        )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job_state(job: str) -> tuple[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30
    ).stdout
    state = re.search(r"JobState=(\S+)", out)
    code = re.search(r"ExitCode=(\S+)", out)
    return (state.group(1) if state else "?", code.group(1) if code else "?")


def _logs(tmp_path: Path) -> str:
    parts = []
    for path in sorted([*tmp_path.glob("rlix-*.out"), *tmp_path.glob("out/logs/*")]):
        parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-2500:]}")
    return "\n".join(parts)


@pytest.mark.timeout(900)
def test_the_sbatch_template_runs_two_pipelines_to_the_end(slurm: None, tmp_path: Path) -> None:
    from rlix_async.models.tiny import save_tiny_llama

    model = save_tiny_llama(tmp_path / "model", seed=0, vocab_size=512, layers=1, hidden=64)
    keys = tmp_path / "keys"
    cli = [sys.executable, "-m", "rlix_async.cli"]
    subprocess.run([*cli, "keygen", str(keys)], check=True, capture_output=True, timeout=60)
    for pid in ("left", "right"):  # each driver its own key (launchers/README.md)
        subprocess.run(
            [*cli, "keygen", str(keys), "--client", f"driver-{pid}", "--role", "driver",
             "--pipeline", pid],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
    subprocess.run(
        [*cli, "keygen", str(keys), "--client", "shard", "--role", "shard", "--pipeline", "*"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    cfg = tmp_path / "pipelines.yaml"
    cfg.write_text(CONFIG.format(steps=STEPS, model=model))
    out = tmp_path / "out"
    env = {
        **os.environ,
        "REPO": str(ROOT),
        "VENV": str(Path(sys.executable).parent),
        "KEYS": str(keys),
        "PIPELINES": str(cfg),
        "OUT": str(out),
        "PORT": str(_free_port()),
        "IFACE": "lo",  # this machine's only address we may use
    }
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--chdir={tmp_path}",
         f"--output={tmp_path}/rlix-%j.out", str(ROOT / "launchers" / "slurm" / "rlix.sbatch")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 600
    state, code = _job_state(job)
    while state in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "?"):
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], timeout=30)
            pytest.fail(f"job {job} still {state} after 600 s\n{_logs(tmp_path)}")
        time.sleep(2)
        state, code = _job_state(job)
    assert (state, code) == ("COMPLETED", "0:0"), _logs(tmp_path)
    for pid in ("left", "right"):
        metrics = [json.loads(x) for x in (out / pid / "metrics.jsonl").read_text().splitlines()]
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), _logs(tmp_path)
    assert (out / "nodes" / job).is_dir()  # the launcher's done-markers, per job
