"""``rlix-async bench delta --run DIR``: the figures from a run's step rows, and a
one-line refusal (exit 2) where the run has none."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from rlix_async.bench.delta import DeltaBenchError, summarize


def _row(step: int, **delta: float) -> dict[str, float]:
    return {"step": step, "train_s": 9.0, "wait_s": 1.0, **delta}


def _encoded(version: int, changed: float, wire: float) -> dict[str, float]:
    return {
        "delta_version": version,
        "delta_changed_fraction": changed,
        "delta_wire_per_full": wire,
        "delta_sparse_per_full": 3 * changed,
        "delta_xor_zstd_per_full": wire,
        "delta_encode_s": 0.5,
        "delta_buckets_full": 0,
        "delta_buckets_sparse": 1,
        "delta_buckets_xor_zstd": 3,
        "sync_bytes_wire": 100,
        "sync_bytes_full": 1000,
        "delta_fallbacks": 1,
    }


def test_figures_from_a_runs_rows(tmp_path: Path) -> None:
    run = tmp_path / "out" / "arith"
    run.mkdir(parents=True)
    rows = [_row(1), _row(2, **_encoded(1, 0.1, 0.2)), _row(3, **_encoded(2, 0.3, 0.4))]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n{cut by a kill")
    result = summarize(tmp_path / "out")
    assert result["versions"] == 2
    assert result["changed_fraction"] == pytest.approx(0.2)
    assert result["wire_per_full"] == pytest.approx(0.3)
    assert result["encode_over_step"] == pytest.approx(0.05)
    assert result["buckets"] == {"full": 0, "sparse": 2, "xor_zstd": 6}
    assert result["sent_wire_per_full"] == pytest.approx(0.1)
    assert result["pipelines"]["arith"]["versions"] == 2
    assert summarize(run)["versions"] == 2  # a pipeline's own directory too


def test_a_run_without_delta_rows_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_row(1)) + "\n")
    with pytest.raises(DeltaBenchError, match="weights_endpoint"):
        summarize(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "rlix_async.cli", "bench", "delta", "--run", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
