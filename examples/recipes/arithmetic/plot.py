"""Draw the arithmetic recipe's curves: greedy eval accuracy and batch reward over time.

    python examples/recipes/arithmetic/plot.py [RUN_DIR] [--png PATH]

RUN_DIR is the launch's ``out`` (default: rlix-out beside this file); the picture
shows every pipeline in it, eval accuracy against wall-clock minutes since the first
evaluation (with its step) and the batch reward.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlix_async.demo import read_metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, nargs="?", default=Path(__file__).parent / "rlix-out")
    ap.add_argument("--png", type=Path, default=None, help="default: RUN/arithmetic.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlix_async.observe.timeline import pipeline_colours

    runs = sorted(d for d in args.run.iterdir() if (d / "metrics.jsonl").is_file())
    colour = pipeline_colours([run.name for run in runs])  # as in a timeline of the run
    fig, (acc, rew) = plt.subplots(1, 2, figsize=(10, 4))
    for run in runs:
        evals = read_metrics(args.run, run.name, evals=True)
        steps = read_metrics(args.run, run.name)
        if not evals:
            continue
        t0 = evals[0]["time"]
        minutes = [(r["time"] - t0) / 60 for r in evals]
        acc.plot(
            minutes,
            [r["eval/reward"] for r in evals],
            marker="o",
            label=run.name,
            color=colour[run.name],
        )
        for m, r in zip(minutes, evals, strict=True):
            acc.annotate(str(r["step"]), (m, r["eval/reward"]), fontsize=7, alpha=0.7)
        rew.plot(
            [r["step"] for r in steps],
            [r["reward"] for r in steps],
            label=run.name,
            color=colour[run.name],
        )
    acc.set(
        xlabel="minutes since the first evaluation (labels: step)", ylabel="greedy eval accuracy"
    )
    rew.set(xlabel="training step", ylabel="mean reward of the step's batch (sampled)")
    for ax in (acc, rew):
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png = args.png or args.run / "arithmetic.png"
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
