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
  ``requested`` events): the same seed must draw the same rows. Which drawn rows
  came back in time for which step depends on timing; the share of rows trained
  alone that were trained shared too is reported, with the trajectories dropped or
  stopped as stale;
- batch size: trajectories trained per step;
- staleness: per step, how many versions behind the oldest trajectory trained was,
  against the pipeline's bound (the buffer drops what is older, so this guards the
  buffer rather than measuring sharing);
- the greedy eval curve at every step asked for (a missing evaluation fails the
  verdict): per step, the shared minus alone difference paired by seed, judged
  against a 95% interval of its mean (Student's t, at least one eval question);
  two seeds at least.

Times differ (sharing waits for devices, and on this 2-core machine the neighbour's
processes take CPU). Neither changes the recipe.
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
    trained_rows: dict[int, list[int]]  # step -> the rows of the groups it trained on
    batch: dict[int, int]  # step -> trajectories trained
    lag: dict[int, int]  # step -> versions behind of its oldest trajectory
    evals: dict[int, float]  # step -> greedy eval accuracy
    eval_n: int  # eval questions
    bound: int  # max_trajectory_age_steps
    wall_s: float = 0.0
    stale: int = 0  # trajectories dropped or stopped as too old (never trained)
    shrinks: int = 0  # the recipe's shard shrunk (journal)
    neighbour_steps: int = 0
    # evaluations that ran on other weights than their step's (a later version: the
    # pipeline evaluates on weights of at least its step), as [step, min, max]
    eval_off_step: list[list[int]] = field(default_factory=list)
    pipeline: str = RECIPE  # the pipeline this record is of


def _last_run(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events since the last fresh start: an earlier, interrupted attempt in the same
    directory must not count twice."""
    starts = [i for i, e in enumerate(events) if e["ev"] == "start" and e.get("fresh")]
    return events[starts[-1] :] if starts else events


def read_run(
    out: Path, mode: str, seed: int, bound: int, wall_s: float, pipeline: str = RECIPE
) -> RunRecord:
    """``pipeline``'s record in the run written to ``out``."""
    from rlix_async.demo import journal_counts
    from rlix_async.rollout.ledger import LEDGER, read_events, tally
    from rlix_async.rollout.records import read_metrics

    events = _last_run(list(read_events(out / pipeline / LEDGER)))
    row_of = {e["g"]: e["row"] for e in events if e["ev"] == "requested"}
    rows = [e["row"] for e in events if e["ev"] == "requested"]
    # the batch taken at version v is trained into step v + 1
    trained_rows = {
        e["v"] + 1: sorted(row_of[g] for g in e["g"]) for e in events if e["ev"] == "taken"
    }
    steps = read_metrics(out, pipeline)
    batch: dict[int, int] = {}
    lag: dict[int, int] = {}
    trained = 0
    for r in steps:
        batch[r["step"]] = r["trained"] - trained
        trained = r["trained"]
        # step k trains at version k - 1 on trajectories from these versions
        lag[r["step"]] = r["step"] - 1 - min(r["trained_on_versions"])
    evals = read_metrics(out, pipeline, evals=True)
    neighbour = read_metrics(out, NEIGHBOUR)
    t = tally(out / pipeline / LEDGER)
    return RunRecord(
        mode=mode,
        seed=seed,
        rows=rows,
        trained_rows=trained_rows,
        batch=batch,
        lag=lag,
        evals={r["step"]: r["eval/reward"] for r in evals},
        eval_n=int(evals[0]["eval/n"]) if evals else 0,
        bound=bound,
        wall_s=round(wall_s, 1),
        stale=t.dropped_stale + t.cancelled_stale,
        shrinks=journal_counts(out / "journal.jsonl").get(pipeline, {}).get("shrinks", 0),
        neighbour_steps=neighbour[-1]["step"] if neighbour else 0,
        eval_off_step=[
            [r["step"], r["eval/weight_version_min"], r["eval/weight_version_max"]]
            for r in evals
            if (r.get("eval/weight_version_min"), r.get("eval/weight_version_max"))
            != (r["step"], r["step"])
        ],
        pipeline=pipeline,
    )


# Student's t, two-sided 95%, by degrees of freedom (no scipy for eleven numbers)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306}


def interval95(values: Sequence[float]) -> float:
    """Half the width of a 95% interval of the mean of ``values`` (two at least)."""
    return T95.get(len(values) - 1, 2.0) * statistics.stdev(values) / math.sqrt(len(values))


def _overlap(a: dict[int, list[int]], b: dict[int, list[int]]) -> float:
    """The share of the rows ``a`` trained on that ``b`` trained on too (as multisets)."""
    from collections import Counter

    ca = Counter(r for rows in a.values() for r in rows)
    cb = Counter(r for rows in b.values() for r in rows)
    total = sum(ca.values())
    return sum((ca & cb).values()) / total if total else 0.0


def compare(runs: Sequence[RunRecord], eval_steps: Sequence[int]) -> dict[str, Any]:
    """Alone against shared, paired by seed: the rules above. ``eval_steps``: the steps
    every run was asked to evaluate at; a run missing one is not transparent (an eval
    that failed or was skipped must not shrink the comparison to nothing)."""
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
                # drawn in the seed's order: must hold whatever the timing
                "same_data_order": n > 0 and a.rows[:n] == b.rows[:n],
                # which drawn rows came back in time for which step depends on timing
                "trained_rows_overlap": round(_overlap(a.trained_rows, b.trained_rows), 3),
                "same_batch_sizes": a.batch == b.batch,
                # the buffer drops what is over the bound, so this is a guard, not a finding
                "staleness_within_bound": all(v <= r.bound for r in (a, b) for v in r.lag.values()),
                "max_lag": {
                    "alone": max(a.lag.values(), default=0),
                    "shared": max(b.lag.values(), default=0),
                },
                "stale": {"alone": a.stale, "shared": b.stale},
                "evals_complete": all(st in r.evals for r in (a, b) for st in eval_steps),
                # an eval on later weights than its step's would shift that curve
                "evals_on_their_step": not a.eval_off_step and not b.eval_off_step,
                "wall_s": {"alone": a.wall_s, "shared": b.wall_s},
                "recipe_shrinks": {"alone": a.shrinks, "shared": b.shrinks},
                "neighbour_steps": b.neighbour_steps,
            }
        )
    curve = []
    one_question = 1 / max(min((r.eval_n for r in runs if r.eval_n), default=1), 1)
    for step in eval_steps:
        pairs = [
            (by[("alone", s)].evals[step], by[("shared", s)].evals[step])
            for s in seeds
            if step in by[("alone", s)].evals and step in by[("shared", s)].evals
        ]
        point: dict[str, Any] = {"step": step, "seeds": len(pairs)}
        for i, mode in enumerate(MODES):
            values = [p[i] for p in pairs]
            point[mode] = {
                "mean": statistics.fmean(values) if values else math.nan,
                "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
                "values": values,
            }
        diffs = [b - a for a, b in pairs]
        point["difference"] = statistics.fmean(diffs) if diffs else math.nan
        if len(diffs) >= 2:
            # paired by seed: a 95% interval of the mean difference, at least one question
            point["noise"] = max(interval95(diffs), one_question)
            point["within_noise"] = abs(point["difference"]) <= point["noise"] + 1e-9
        else:
            point["noise"], point["within_noise"] = None, None  # one seed: not judged
        curve.append(point)
    return {
        "seeds": seeds,
        "per_seed": per_seed,
        "eval_curve": curve,
        "transparent": len(per_seed) >= 2
        and all(
            p["same_data_order"]
            and p["same_batch_sizes"]
            and p["staleness_within_bound"]
            and p["evals_complete"]
            and p["evals_on_their_step"]
            for p in per_seed
        )
        and bool(curve)
        and all(p["within_noise"] is True for p in curve),
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


class TransparencyError(RuntimeError):
    """A run of the bench did not finish. One line."""


def run_until_done(
    cfg: LaunchConfig, wait_for: Sequence[str] = (RECIPE,), poll_s: float = 1.0
) -> dict[str, float]:
    """Launch ``cfg`` and stop everything once the pipelines in ``wait_for`` have
    finished (a neighbour never does). Returns the seconds from the launch until each
    of them exited."""
    from rlix_async.launch import Launcher

    def _terminated(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    launcher = Launcher(cfg)  # a bad recipe is a LaunchError here, before anything starts
    previous = signal.signal(signal.SIGTERM, _terminated)
    t0 = time.monotonic()
    finished: dict[str, float] = {}
    try:
        launcher.start()
        try:
            while len(finished) < len(wait_for) and launcher.step():
                for pid in wait_for:
                    if pid in launcher.exit_codes and pid not in finished:
                        finished[pid] = time.monotonic() - t0
                time.sleep(poll_s)
        except RuntimeError as exc:  # the launcher gave up on a process
            raise TransparencyError(f"{exc}; see {cfg.out}/logs") from None
        failed = {p: launcher.exit_codes.get(p) for p in wait_for if launcher.exit_codes.get(p)}
        missing = [p for p in wait_for if p not in launcher.exit_codes]
        if failed or missing:
            raise TransparencyError(
                f"{', '.join(sorted({*failed, *missing}))} did not finish (exit codes "
                f"{launcher.exit_codes}); see {cfg.out}/logs"
            )
        # a pipeline restarted from its checkpoint did steps twice: its wall and curve
        # are not a run's
        restarted = [p for p in wait_for if launcher.pipelines[p].restarts]
        if restarted:
            raise TransparencyError(f"{', '.join(restarted)} restarted mid-run; see {cfg.out}/logs")
        for pid in wait_for:  # the last exit, seen by the loop's final step
            finished.setdefault(pid, time.monotonic() - t0)
        return finished
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
    still has pairs). A run whose ``record.json`` says it finished with these steps is
    read again, not rerun; any other leftover directory is cleared first."""
    import shutil

    runs = []
    for seed in seeds:
        for mode in MODES:
            run_dir = Path(out) / f"{mode}-seed{seed}"
            record = run_dir / "record.json"
            cfg = transparency_config(str(run_dir), mode, seed, steps, eval_every, log)
            bound = cfg.pipelines[0].max_trajectory_age_steps
            done = json.loads(record.read_text()) if record.exists() else None
            if (
                done is None
                or "bench" in done  # --pair's run (its record names it)
                or (done.get("steps", steps), done.get("eval_every", eval_every))
                != (steps, eval_every)
            ):
                for leftover in ("journal.jsonl", RECIPE, NEIGHBOUR, "logs"):
                    path = run_dir / leftover
                    shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
                log(f"{mode} seed {seed}: {steps} steps, eval every {eval_every} ({run_dir})")
                wall = run_until_done(cfg)[RECIPE]
                done = {"wall_s": wall, "steps": steps, "eval_every": eval_every}
                record.write_text(json.dumps(done))
            run = read_run(run_dir, mode, seed, bound, done["wall_s"])
            log(f"  {mode} seed {seed}: {run.wall_s:.0f} s; eval {run.evals}")
            runs.append(run)
    result = compare(runs, list(range(0, steps + 1, eval_every)))
    result["runs"] = [asdict(r) for r in runs]
    result["steps"], result["eval_every"] = steps, eval_every
    (Path(out) / "transparency.json").write_text(json.dumps(result, indent=2))
    plot_transparency(runs, Path(out) / "transparency.png")
    return result


def draw_eval_curves(ax: Any, runs: Sequence[RunRecord], title: str) -> None:
    """Each run's greedy eval curve on ``ax``: alone solid, shared dashed."""
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
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_transparency(runs: Sequence[RunRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    draw_eval_curves(ax, runs, "arithmetic recipe: alone vs time-shared with a neighbour")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_transparency(result: dict[str, Any]) -> str:
    def pair(d: dict[str, Any]) -> str:
        return f"{d['alone']}/{d['shared']}"

    lines = []
    for p in result["per_seed"]:
        lines.append(
            f"seed {p['seed']}: data order {'same' if p['same_data_order'] else 'DIFFERENT'} "
            f"({p['rows_compared']} rows drawn; {p['trained_rows_overlap']:.0%} of the rows "
            f"trained alone also trained shared), batch sizes "
            f"{'same' if p['same_batch_sizes'] else 'DIFFERENT'}, evals "
            f"{'complete' if p['evals_complete'] else 'MISSING'}"
            f"{'' if p['evals_on_their_step'] else ' (some on LATER weights)'}; alone/shared: max lag "
            f"{pair(p['max_lag'])} ({'within' if p['staleness_within_bound'] else 'OVER'} the "
            f"bound), stale {pair(p['stale'])}, wall {p['wall_s']['alone']:.0f}/"
            f"{p['wall_s']['shared']:.0f} s, recipe shrinks {pair(p['recipe_shrinks'])}, "
            f"neighbour steps {p['neighbour_steps']}"
        )
    lines.append("step  alone mean (sd)   shared mean (sd)   paired diff  noise   within")
    for c in result["eval_curve"]:
        a, s = c["alone"], c["shared"]
        noise = "  -  " if c["noise"] is None else f"{c['noise']:.3f}"
        lines.append(
            f"{c['step']:4d}  {a['mean']:.3f} ({a['sd']:.3f})     {s['mean']:.3f} ({s['sd']:.3f})"
            f"      {c['difference']:+.3f}     {noise}   {c['within_noise']}"
        )
    lines.append(f"transparent: {result['transparent']}")
    return "\n".join(lines)
