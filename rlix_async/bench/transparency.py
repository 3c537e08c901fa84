"""``rlix-async bench transparency``: does time-sharing change a recipe?

For each seed, the arithmetic recipe runs twice with the same pipeline config: alone
(its trainer on device 0, its vLLM shard on device 1), and time-shared with a
neighbour pipeline (the same recipe, another seed, no evaluation) that trains on
device 2 and rolls out on devices 1 and 2. Device 1 is contested: whenever the
neighbour's demand wins it, the recipe's shard is shrunk (its requests aborted and
resumed later) and the recipe waits. The neighbour is stopped when the recipe has
done its steps.

What is compared, per seed and over seeds (the pure part, :func:`compare`, is tested
without engines):

- data order: the training rows in the order they were drawn (the ledger's
  ``requested`` events): the same seed must draw the same rows;
- batch size: trajectories trained per step;
- staleness: per step, how many versions behind the oldest trajectory trained was,
  against the pipeline's bound;
- the greedy eval curve: per step, the mean over seeds alone and shared, the seed
  spread, and whether the difference lies within seed noise (twice the standard error
  of the difference of the means, at least one eval question).

Times differ (sharing waits for devices, and on this 2-core machine the neighbour's
processes take CPU); which rows land in which step may differ too, because groups
come back in a different order. Neither changes the recipe.
"""

from __future__ import annotations

import copy
import json
import math
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rlix_async.config import LaunchConfig, convert

RECIPE = "arithmetic"
NEIGHBOUR = "neighbour"
MODES = ("alone", "shared")


@dataclass
class RunRecord:
    """What one run did, read back from its files."""

    mode: str
    seed: int
    rows: list[int]  # training rows in the order they were drawn
    batch: dict[int, int]  # step -> trajectories trained
    lag: dict[int, int]  # step -> versions behind of its oldest trajectory
    evals: dict[int, float]  # step -> greedy eval accuracy
    eval_n: int  # eval questions
    bound: int  # max_trajectory_age_steps
    wall_s: float = 0.0
    shrinks: int = 0  # the recipe's shard shrunk (journal)
    neighbour_steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def read_run(out: Path, mode: str, seed: int, bound: int, wall_s: float) -> RunRecord:
    from rlix_async.demo import journal_counts, read_metrics
    from rlix_async.rollout.ledger import LEDGER, read_events

    rows = [e["row"] for e in read_events(out / RECIPE / LEDGER) if e["ev"] == "requested"]
    steps = read_metrics(out, RECIPE)
    batch: dict[int, int] = {}
    lag: dict[int, int] = {}
    trained = 0
    for r in steps:
        batch[r["step"]] = r["trained"] - trained
        trained = r["trained"]
        # step k trains at version k - 1 on trajectories from these versions
        lag[r["step"]] = r["step"] - 1 - min(r["trained_on_versions"])
    evals = read_metrics(out, RECIPE, evals=True)
    neighbour = read_metrics(out, NEIGHBOUR)
    return RunRecord(
        mode=mode,
        seed=seed,
        rows=rows,
        batch=batch,
        lag=lag,
        evals={r["step"]: r["eval/reward"] for r in evals},
        eval_n=int(evals[0]["eval/n"]) if evals else 0,
        bound=bound,
        wall_s=round(wall_s, 1),
        shrinks=journal_counts(out / "journal.jsonl").get(RECIPE, {}).get("shrinks", 0),
        neighbour_steps=neighbour[-1]["step"] if neighbour else 0,
    )


def compare(runs: Sequence[RunRecord]) -> dict[str, Any]:
    """Alone against shared: the rules above, per seed and over seeds."""
    by = {(r.mode, r.seed): r for r in runs}
    seeds = sorted({r.seed for r in runs if ("alone", r.seed) in by and ("shared", r.seed) in by})
    per_seed = []
    for s in seeds:
        a, b = by[("alone", s)], by[("shared", s)]
        n = min(len(a.rows), len(b.rows))
        per_seed.append(
            {
                "seed": s,
                "rows_compared": n,
                "same_data_order": n > 0 and a.rows[:n] == b.rows[:n],
                "same_batch_sizes": a.batch == b.batch,
                "staleness_within_bound": all(v <= r.bound for r in (a, b) for v in r.lag.values()),
                "max_lag": {
                    "alone": max(a.lag.values(), default=0),
                    "shared": max(b.lag.values(), default=0),
                },
                "wall_s": {"alone": a.wall_s, "shared": b.wall_s},
                "recipe_shrinks": {"alone": a.shrinks, "shared": b.shrinks},
                "neighbour_steps": b.neighbour_steps,
            }
        )
    curve = []
    eval_steps = sorted(set.intersection(*(set(r.evals) for r in runs))) if runs else []
    for step in eval_steps:
        point: dict[str, Any] = {"step": step}
        for mode in MODES:
            values = [by[(mode, s)].evals[step] for s in seeds]
            point[mode] = {
                "mean": statistics.fmean(values) if values else math.nan,
                "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                "values": values,
            }
        k = len(seeds)
        se = math.sqrt((point["alone"]["sd"] ** 2 + point["shared"]["sd"] ** 2) / max(k, 1))
        one_question = 1 / max(min(r.eval_n for r in runs), 1)
        point["difference"] = point["shared"]["mean"] - point["alone"]["mean"]
        point["noise"] = max(2 * se, one_question)
        point["within_noise"] = abs(point["difference"]) <= point["noise"] + 1e-9  # float sums
        curve.append(point)
    return {
        "seeds": seeds,
        "per_seed": per_seed,
        "eval_curve": curve,
        "transparent": bool(per_seed)
        and all(
            p["same_data_order"] and p["same_batch_sizes"] and p["staleness_within_bound"]
            for p in per_seed
        )
        and all(p["within_noise"] for p in curve),
    }


def transparency_config(
    out: str, mode: str, seed: int, steps: int, eval_every: int, log: Callable[[str], None]
) -> LaunchConfig:
    """The recipe's own config (seed, steps and eval cadence set), alone or with the
    neighbour added on a third device."""
    from rlix_async.recipes import prepare_recipe

    raw, _ = prepare_recipe(RECIPE, out, log)
    recipe = raw["pipelines"][0]
    recipe.update(seed=seed, steps=steps, eval_every=eval_every, checkpoint_every=steps)
    if mode == "shared":
        # The neighbour is the same recipe with another seed and no evaluation: on this
        # machine every logical device shares the same 2 cores, and a token-id toy
        # pipeline (hundreds of tiny steps a minute) took nearly all of them, starving
        # the recipe of CPU rather than of devices.
        raw["cluster"]["gpus_per_node"] = 3
        neighbour = copy.deepcopy(recipe)
        neighbour.update(
            id=NEIGHBOUR,
            seed=100 + seed,
            steps=100_000,  # stopped when the recipe is done
            eval_every=0,
            checkpoint_every=100_000,
            clusters={
                "actor_train": {"tp": 1, "devices": [2]},
                "actor_infer": {"tp": 1, "devices": [1, 2]},
            },
        )
        neighbour["data"] = {k: v for k, v in neighbour["data"].items() if k != "eval"}
        raw["pipelines"].append(neighbour)
    return convert(raw, LaunchConfig, f"bench transparency ({mode})")


def run_until_recipe_done(cfg: LaunchConfig, poll_s: float = 1.0) -> float:
    """Launch ``cfg`` and stop everything once the recipe's pipeline has finished (the
    neighbour never does). Returns the wall time."""
    from rlix_async.launch import Launcher

    def _terminated(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, _terminated)
    launcher = Launcher(cfg)
    t0 = time.monotonic()
    try:
        launcher.start()
        while RECIPE not in launcher.exit_codes and launcher.step():
            time.sleep(poll_s)
        if launcher.exit_codes.get(RECIPE) != 0:
            raise RuntimeError(f"{RECIPE} did not finish: {launcher.exit_codes}")
        return time.monotonic() - t0
    finally:
        launcher.stop()
        signal.signal(signal.SIGTERM, previous)


def run_transparency(
    out: str,
    seeds: Sequence[int],
    steps: int,
    eval_every: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Every (seed, mode) run in turn, alone then shared per seed (so a cut-short bench
    still has pairs); a run whose record exists is not run again."""
    runs = []
    for seed in seeds:
        for mode in MODES:
            run_dir = Path(out) / f"{mode}-seed{seed}"
            record = run_dir / "record.json"
            if record.exists():
                runs.append(RunRecord(**json.loads(record.read_text())))
                continue
            cfg = transparency_config(str(run_dir), mode, seed, steps, eval_every, log)
            log(f"{mode} seed {seed}: {steps} steps, eval every {eval_every} (logs: {run_dir})")
            wall = run_until_recipe_done(cfg)
            bound = cfg.pipelines[0].max_trajectory_age_steps
            run = read_run(run_dir, mode, seed, bound, wall)
            record.write_text(json.dumps(asdict(run)))
            log(f"  {wall:.0f} s; eval {run.evals}")
            runs.append(run)
    result = compare(runs)
    result["runs"] = [asdict(r) for r in runs]
    result["steps"], result["eval_every"] = steps, eval_every
    (Path(out) / "transparency.json").write_text(json.dumps(result, indent=2))
    plot_transparency(runs, Path(out) / "transparency.png")
    return result


def plot_transparency(runs: Sequence[RunRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colour = {"alone": "tab:blue", "shared": "tab:orange"}
    for r in runs:
        steps = sorted(r.evals)
        ax.plot(
            steps,
            [r.evals[s] for s in steps],
            marker="o",
            color=colour[r.mode],
            linestyle="-" if r.mode == "alone" else "--",
            alpha=0.8,
            label=f"{r.mode} seed {r.seed}",
        )
    ax.set(xlabel="training step", ylabel="greedy eval accuracy", ylim=(0, 1.02))
    ax.set_title("arithmetic recipe: alone vs time-shared with a neighbour")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_transparency(result: dict[str, Any]) -> str:
    lines = []
    for p in result["per_seed"]:
        lines.append(
            f"seed {p['seed']}: data order {'same' if p['same_data_order'] else 'DIFFERENT'} "
            f"({p['rows_compared']} rows), batch sizes "
            f"{'same' if p['same_batch_sizes'] else 'DIFFERENT'}, max lag "
            f"{p['max_lag']['alone']}/{p['max_lag']['shared']} (alone/shared, "
            f"{'within' if p['staleness_within_bound'] else 'OVER'} the bound), wall "
            f"{p['wall_s']['alone']:.0f}/{p['wall_s']['shared']:.0f} s, recipe shrinks "
            f"{p['recipe_shrinks']['alone']}/{p['recipe_shrinks']['shared']}, neighbour "
            f"steps {p['neighbour_steps']}"
        )
    lines.append("step  alone mean (sd)   shared mean (sd)   difference  noise  within")
    for c in result["eval_curve"]:
        a, s = c["alone"], c["shared"]
        lines.append(
            f"{c['step']:4d}  {a['mean']:.3f} ({a['sd']:.3f})     {s['mean']:.3f} ({s['sd']:.3f})"
            f"      {c['difference']:+.3f}     {c['noise']:.3f}  {c['within_noise']}"
        )
    lines.append(f"transparent: {result['transparent']}")
    return "\n".join(lines)
