"""A pipeline's metrics to TensorBoard and Weights & Biases (rlix_async/observe/loggers.py):
real event files and a real offline wandb run, read back."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from rlix_async.observe.loggers import LoggerError, Loggers, flush_at_exit, scalars

ROWS = [
    {"step": 1, "reward": 0.25, "trained_on_versions": [0], "time": 1.0, "loss": 0.1},
    {"step": 2, "reward": 0.75, "time": 2.0, "loss": math.nan},
    {"step": 2, "eval/reward": 0.5, "eval/n": 40.0, "time": 3.0},
]


def test_only_finite_numbers_become_scalars() -> None:
    assert scalars(ROWS[0]) == {"reward": 0.25, "loss": 0.1}
    assert scalars(ROWS[1]) == {"reward": 0.75}
    assert scalars({"step": 3, "ok": True, "eval/error": "boom"}) == {}


@pytest.mark.timeout(60)
def test_tensorboard_gets_every_row_at_its_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    loggers = Loggers(["tensorboard"], tmp_path, "exp", {})
    for row in ROWS:
        loggers.log(row)
    loggers.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.25), (2, 0.75)]
    assert [(e.step, e.value) for e in events.Scalars("eval/reward")] == [(2, 0.5)]
    assert [e.step for e in events.Scalars("loss")] == [1]  # the NaN was left out
    assert "time" not in events.Tags()["scalars"]


@pytest.mark.timeout(120)
def test_wandb_runs_offline_with_no_network(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    loggers = Loggers(["wandb"], tmp_path, "exp", {"train": {"lr": 1e-5}})
    for row in ROWS:
        loggers.log(row)
    loggers.close()
    # what a pipeline does before its hard exit: finish() alone returns before wandb's
    # service has written the run (seen in CI: a file holding only its header)
    flush_at_exit()
    (run,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb")
    records = run.read_bytes()  # the offline run's protobuf records: keys and JSON values
    for needle in (b"eval/reward", b"0.25", b"0.75", b"0.5", b"lr"):
        assert needle in records, needle


def test_a_logger_whose_package_is_missing_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb now raises ImportError
    with pytest.raises(LoggerError, match=r"wandb needs the wandb package") as err:
        Loggers(["wandb"], tmp_path, "exp", {})
    assert "\n" not in str(err.value)
