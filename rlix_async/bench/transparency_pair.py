"""``rlix-async bench transparency --pair``: the main demo's two recipes, each alone and
both time-shared, per seed.

The pipelines are those of ``rlix-async demo`` (``rlix_async/recipes/time_sharing.yaml``):
the arithmetic recipe and the agent recipe, on SmolLM2, over 3 logical devices with the
middle one shared. Per seed, three runs of the same config: each pipeline with the other
removed (its own devices, nothing else running), then both. Every pipeline gets the
seed, so alone and shared draw the same data.

Two questions, each answered per pipeline and over seeds:

- does time-sharing change what a pipeline learns? :func:`compare` of the single-recipe
  bench (data order, batch sizes, staleness, the greedy eval curve paired by seed);
- what does it buy? The wall time of both pipelines run one after the other (the sum
  of their alone runs, each from its launch to its exit: engine starts included, as a
  user running them in turn would pay) against the shared run's (launch until both
  exited): the gain, with a 95% interval over seeds; and each pipeline's own wall
  shared against alone (its slowdown).
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlix_async.bench.transparency import (
    RunRecord,
    compare,
    draw_eval_curves,
    format_transparency,
    interval95,
    read_run,
    run_until_done,
)
from rlix_async.config import LaunchConfig, convert

PAIR = "time_sharing"  # the recipe `rlix-async demo` runs
SHARED = "shared"


def pair_config(
    out: str, mode: str, seed: int, steps: int, eval_every: int, log: Callable[[str], None]
) -> LaunchConfig:
    """The main demo's config with every pipeline's seed, steps and eval cadence set;
    ``mode``: a pipeline's id (that one alone) or ``shared`` (both)."""
    from rlix_async.recipes import prepare_recipe

    raw, _ = prepare_recipe(PAIR, out, log)
    for p in raw["pipelines"]:
        p.update(seed=seed, steps=steps, eval_every=eval_every, checkpoint_every=steps)
    if mode != SHARED:
        raw["pipelines"] = [p for p in raw["pipelines"] if p["id"] == mode]
    return convert(raw, LaunchConfig, f"bench transparency --pair ({mode})")


def wall_gain(runs: Sequence[RunRecord]) -> dict[str, Any]:
    """Per seed with every pipeline's alone run and the shared run: the pipelines one
    after the other (the sum of their alone walls) over the shared run's wall (until
    the last one exited): above 1, time-sharing finished both sooner. And each
    pipeline's shared wall over its alone wall. Alone, a pipeline keeps its devices of
    the 3: on a CPU node they are shares of the cores taken round robin (device 2
    shares device 0's core), so each alone run has every core; on GPUs the baseline
    would leave one device idle and flatter the gain."""
    pipelines = sorted({r.pipeline for r in runs})
    by = {(r.mode, r.seed, r.pipeline): r for r in runs}
    per_seed: list[dict[str, Any]] = []
    for seed in sorted({r.seed for r in runs}):
        if not all(("alone", seed, p) in by and (SHARED, seed, p) in by for p in pipelines):
            continue
        alone = {p: by[("alone", seed, p)].wall_s for p in pipelines}
        shared = {p: by[(SHARED, seed, p)].wall_s for p in pipelines}
        both = max(shared.values())
        per_seed.append(
            {
                "seed": seed,
                "alone_s": alone,
                "shared_s": shared,
                "one_after_the_other_s": round(sum(alone.values()), 1),
                "shared_both_s": both,
                "gain": round(sum(alone.values()) / both, 3),
                "slowdown": {p: round(shared[p] / alone[p], 3) for p in pipelines},
            }
        )
    gains = [s["gain"] for s in per_seed]
    return {
        "per_seed": per_seed,
        "gain_mean": round(statistics.fmean(gains), 3) if gains else None,
        "gain_interval": interval95(gains) if len(gains) > 1 else None,
        "slowdown_mean": {
            p: round(statistics.fmean(s["slowdown"][p] for s in per_seed), 3)
            for p in pipelines
            if per_seed
        },
    }


def run_pair_transparency(
    out: str,
    seeds: Sequence[int],
    steps: int,
    eval_every: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Per seed: each pipeline alone, then both (so a cut-short bench still has whole
    seeds). A run whose ``record.json`` says it finished with these steps is read
    again, not rerun; any other leftover directory is cleared first."""
    from rlix_async.recipes import recipe_raw

    runs: list[RunRecord] = []
    ids = [p["id"] for p in recipe_raw(PAIR)["pipelines"]]
    for seed in seeds:
        for mode in (*ids, SHARED):
            run_dir = Path(out) / f"{mode}-seed{seed}"
            cfg = pair_config(str(run_dir), mode, seed, steps, eval_every, log)
            record = run_dir / "record.json"
            done = json.loads(record.read_text()) if record.exists() else None
            if done is None or (done.get("bench"), done["steps"], done["eval_every"]) != (
                PAIR,
                steps,
                eval_every,
            ):
                for leftover in ("journal.jsonl", "logs", *ids):
                    path = run_dir / leftover
                    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
                log(f"{mode} seed {seed}: {steps} steps, eval every {eval_every} ({run_dir})")
                walls = run_until_done(cfg, [p.id for p in cfg.pipelines])
                done = {"bench": PAIR, "wall_s": walls, "steps": steps, "eval_every": eval_every}
                record.write_text(json.dumps(done))
            for p in cfg.pipelines:
                run = read_run(
                    run_dir,
                    "alone" if mode != SHARED else SHARED,
                    seed,
                    p.max_trajectory_age_steps,
                    done["wall_s"][p.id],
                    pipeline=p.id,
                )
                log(f"  {mode} seed {seed}: {p.id} {run.wall_s:.0f} s; eval {run.evals}")
                runs.append(run)
    eval_steps = list(range(0, steps + 1, eval_every))
    per_pipeline = {pid: compare([r for r in runs if r.pipeline == pid], eval_steps) for pid in ids}
    result: dict[str, Any] = {
        "pipelines": per_pipeline,
        "wall": wall_gain(runs),
        "transparent": bool(per_pipeline) and all(c["transparent"] for c in per_pipeline.values()),
        "runs": [asdict(r) for r in runs],
        "steps": steps,
        "eval_every": eval_every,
    }
    (Path(out) / "transparency.json").write_text(json.dumps(result, indent=2))
    plot_pair(runs, Path(out) / "transparency.png")
    return result


def plot_pair(runs: Sequence[RunRecord], path: Path) -> None:
    """One panel per pipeline: its greedy eval curves, alone (solid) and shared (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pipelines = sorted({r.pipeline for r in runs})
    fig, axes = plt.subplots(1, len(pipelines), figsize=(7 * len(pipelines), 4), squeeze=False)
    for ax, pid in zip(axes[0], pipelines, strict=True):
        mine = [r for r in runs if r.pipeline == pid]
        draw_eval_curves(ax, mine, f"{pid}: alone vs time-shared")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_pair(result: dict[str, Any]) -> str:
    lines = []
    for pid, verdict in result["pipelines"].items():
        lines.append(f"== {pid}")
        lines.append(format_transparency(verdict))
    wall = result["wall"]
    lines.append("== wall time (launch to exit)")
    for s in wall["per_seed"]:
        alone = ", ".join(f"{p} {v:.0f} s" for p, v in s["alone_s"].items())
        shared = ", ".join(f"{p} {v:.0f} s" for p, v in s["shared_s"].items())
        lines.append(
            f"seed {s['seed']}: alone {alone} (one after the other "
            f"{s['one_after_the_other_s']:.0f} s); shared {shared}: both in "
            f"{s['shared_both_s']:.0f} s, gain {s['gain']:.2f}x"
        )
    if wall["gain_mean"] is not None:
        half = wall["gain_interval"]
        lines.append(
            f"gain {wall['gain_mean']:.2f}x"
            + ("" if half is None else f" +- {half:.2f} (95%)")
            + "; each pipeline shared/alone: "
            + ", ".join(f"{p} {v:.2f}x" for p, v in wall["slowdown_mean"].items())
        )
    lines.append(f"transparent: {result['transparent']}")
    return "\n".join(lines)
