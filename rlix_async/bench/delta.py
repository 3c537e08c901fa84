"""``rlix-async bench delta --run DIR``: what weight deltas came to on a real run's
versions, from its step rows (the owner encodes each version it serves to other
nodes: ``weights/delta_source.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean
from typing import Any


class DeltaBenchError(Exception):
    """The run has no delta figures to read (one line: why, and what to change)."""


def _rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill: the rest still counts
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    encoded = [r for r in rows if "delta_version" in r]
    steps = [r for r in rows if "train_s" in r and "wait_s" in r]
    step_s = mean(r["train_s"] + r["wait_s"] for r in steps) if steps else 0.0
    encode_s = mean(r["delta_encode_s"] for r in encoded)
    sent_full = sum(r.get("sync_bytes_full", 0) for r in rows)
    sent_wire = sum(r.get("sync_bytes_wire", 0) for r in rows)
    return {
        "versions": len(encoded),
        "changed_fraction": mean(r["delta_changed_fraction"] for r in encoded),
        # every version is the same model's size: the mean ratio is the bytes' ratio
        "wire_per_full": mean(r["delta_wire_per_full"] for r in encoded),
        "sparse_per_full": mean(r["delta_sparse_per_full"] for r in encoded),
        "xor_zstd_per_full": mean(r["delta_xor_zstd_per_full"] for r in encoded),
        "buckets": {
            kind: sum(r[f"delta_buckets_{kind}"] for r in encoded)
            for kind in ("full", "sparse", "xor_zstd")
        },
        "encode_s": encode_s,
        "step_s": step_s,
        "encode_over_step": encode_s / step_s if step_s else None,
        "sent_bytes_full": sent_full,
        "sent_bytes_wire": sent_wire,
        "sent_wire_per_full": sent_wire / sent_full if sent_full else None,
        "delta_fallbacks": max((r.get("delta_fallbacks", 0) for r in rows), default=0),
    }


def summarize(run: Path) -> dict[str, Any]:
    """Per pipeline of ``run`` (a pipeline's run directory, or a launch's ``out``
    holding several) and over all of them."""
    files = sorted({*run.glob("metrics.jsonl"), *run.glob("*/metrics.jsonl")})
    if not files:
        raise DeltaBenchError(f"{run}: no metrics.jsonl in it or in its subdirectories")
    per = {f.parent.name: _rows(f) for f in files}
    with_deltas = {
        name: rows for name, rows in per.items() if any("delta_version" in r for r in rows)
    }
    if not with_deltas:
        raise DeltaBenchError(
            f"{run}: no step row carries delta figures: the owner encodes versions only "
            "where it serves other nodes (a pipeline's weights_endpoint; set "
            "weights_endpoint=tcp://127.0.0.1:* to measure on one node) with weights.delta: auto"
        )
    everything = [r for rows in with_deltas.values() for r in rows]
    return {
        **_figures(everything),
        "pipelines": {name: _figures(rows) for name, rows in with_deltas.items()},
    }


def format_summary(result: dict[str, Any]) -> str:
    lines = []
    for name, f in result["pipelines"].items():
        over = f["encode_over_step"]
        lines += [
            f"{name}: {f['versions']} versions encoded, {100 * f['changed_fraction']:.2f}% of "
            f"the words changed per version",
            f"  wire/full {f['wire_per_full']:.3f} (every bucket sparse {f['sparse_per_full']:.3f}, "
            f"XOR+zstd {f['xor_zstd_per_full']:.3f}); buckets {f['buckets']}",
            f"  encoding {f['encode_s']:.2f} s a version"
            + (f" = {100 * over:.1f}% of a step ({f['step_s']:.1f} s)" if over else ""),
        ]
        if f["sent_bytes_full"]:
            lines.append(
                f"  sent to other nodes: {f['sent_bytes_wire'] / 2**20:.1f} MiB for "
                f"{f['sent_bytes_full'] / 2**20:.1f} MiB whole ({f['sent_wire_per_full']:.3f}); "
                f"{f['delta_fallbacks']} fell back to whole"
            )
    return "\n".join(lines)
