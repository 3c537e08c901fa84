"""The trainer seam: a backend from outside the package (examples/trainers/sgd_trainer.py)
plugs in by config alone and trains through `rlix-async launch`, two torchrun ranks
under DDP, its versions synced to the shards and exported like the package's own.

Shard workers run the scripted engine (a test double loaded as a custom engine: the
fast tier cannot start vLLM engines); the coordinator, sockets, torchrun trainers,
weight cache and router are real.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.cluster import ROOT, SCRIPTED_ENGINE

from rlix_async.pipeline import TRAINER_THREAD
from rlix_async.rollout.ledger import LEDGER, tally

pytest.importorskip("transformers")

SGD = f"{ROOT / 'examples' / 'trainers' / 'sgd_trainer.py'}:BACKEND"

CONFIG = """
out: {out}
cluster: {{nodes: 1, gpus_per_node: 2}}
engine: {{kind: custom, custom: "{engine}"}}
pipelines:
  - id: {pid}
    steps: 3
    rollout: {{groups_per_step: 2, group_size: 2, max_tokens: 4}}
    model: {{vocab_size: 1000, layers: 1, hidden: 64}}
    train: {{backend: custom, custom: "{trainer}", custom_args: {{momentum: {momentum}}}, lr: 0.05}}
    clusters:
      actor_train: {{tp: 1, devices: [0, 1]}}  # two torchrun ranks
      actor_infer: {{tp: 1, devices: [0, 1]}}
"""


def _launch(
    tmp_path: Path, trainer: str = SGD, momentum: object = 0.9
) -> tuple[subprocess.CompletedProcess[str], Path, str]:
    pid = f"sgd{os.getpid() % 10000}"
    out = tmp_path / "out"
    cfg = tmp_path / "sgd.yaml"
    cfg.write_text(
        CONFIG.format(out=out, pid=pid, engine=SCRIPTED_ENGINE, trainer=trainer, momentum=momentum)
    )
    run = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "launch", str(cfg)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    return run, out, pid


@pytest.mark.timeout(240)
def test_a_trainer_backend_from_outside_the_package_trains_through_launch(tmp_path: Path) -> None:
    run, out, pid = _launch(tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(x) for x in (out / pid / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert "time_sgd_step_s" in r  # the example's own step ran, not a package backend
        assert math.isfinite(r["loss"]) and r["skipped_updates"] == 0
    assert all(r["sync_bytes"] > 0 for r in rows[:-1])  # each new version went to the cache
    t = tally(out / pid / LEDGER)
    assert (t.lost, t.trained) == (0, 3 * 2 * 2), t
    synced = {json.loads(x).get("version") for x in (out / "journal.jsonl").read_text().splitlines()
              if json.loads(x)["ev"] == "synced"}  # fmt: skip
    # the shards took versions the example trained (selective sync may skip one)
    assert max(v for v in synced if v is not None) == 2
    ckpt = torch.load(out / pid / "ckpt" / "step_3.pt", weights_only=True)
    (group,) = ckpt["optim"]["param_groups"]
    assert group["momentum"] == 0.9 and "exp_avg" not in str(ckpt["optim"]["state"])  # SGD
    # exported through the backend's hf_state, like the package's own checkpoints
    hf = tmp_path / "hf"
    export = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "export", str(out / pid / "ckpt" / "step_3.pt"),
         "--hf", str(hf)], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert export.returncode == 0, export.stderr[-2000:]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf))
    for name, value in model.state_dict().items():
        assert torch.equal(value, ckpt["model"][name]), name


@pytest.mark.timeout(240)
def test_every_trainer_call_runs_on_the_pipelines_one_trainer_thread(tmp_path: Path) -> None:
    """reload, train_step, offload and save allocate the trainer's tensors: on threads
    taken from a pool, glibc keeps each one's freed memory in its own arena and the
    process grows to several times its working set (docs/PERF.md, issue 49)."""
    recording = f"{ROOT / 'tests' / 'helpers' / 'thread_recording_trainer.py'}:BACKEND"
    run, out, pid = _launch(tmp_path, trainer=recording)
    assert run.returncode == 0, run.stderr[-3000:]
    from helpers.thread_recording_trainer import RECORD

    calls = [json.loads(x) for x in (out / pid / RECORD).read_text().splitlines()]
    every = {"reload", "train_step", "offload", "save", "weights_for_cache"}
    assert {c[0] for c in calls} == every, calls
    assert all(c[1].startswith(TRAINER_THREAD) for c in calls), calls
    assert len({c[2] for c in calls}) == 1, calls


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("trainer", "momentum", "message"),
    [
        (SGD, 2, "train.custom_args.momentum: 2 is not in [0, 1)"),  # the backend's own check
        (f"{ROOT / 'examples' / 'trainers' / 'nope.py'}:BACKEND", 0.9, "train.custom: "),
        (
            f"{ROOT / 'examples' / 'trainers' / 'sgd_trainer.py'}:SgdTrainer",
            0.9,
            "not a trainer backend",
        ),
    ],
)
def test_a_trainer_backend_refusing_its_pipeline_stops_the_launch_before_anything_starts(
    tmp_path: Path, trainer: str, momentum: object, message: str
) -> None:
    run, out, _ = _launch(tmp_path, trainer, momentum)
    assert run.returncode == 2, run.stderr[-2000:]
    (line,) = run.stderr.strip().splitlines()
    assert message in line and "Traceback" not in run.stderr
    assert not (out / "logs").exists()  # nothing was started
