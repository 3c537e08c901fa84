"""What a pipeline writes about its run, beside its checkpoints and ledger.

``metrics.jsonl`` (one row per step, and one per evaluation with its ``eval/...``
keys), mirrored to the configured loggers (tensorboard, wandb: views of that file),
and ``samples.jsonl`` (a few trajectories per step as text, for text recipes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from rlix_async.config import PipelineConfig
from rlix_async.observe.loggers import Loggers
from rlix_async.protocols.batch import Group
from rlix_async.rollout.episodes import episode_stats, turns_of
from rlix_async.rollout.prompts import Recipe, finite_mean, truncated


class RunRecords:
    """The run's metric rows and samples under ``cfg.run_dir``."""

    def __init__(self, cfg: PipelineConfig, recipe: Recipe | None) -> None:
        self.cfg, self.recipe, self.out = cfg, recipe, cfg.run_dir
        self.loggers: Loggers | None = None

    def open_loggers(self) -> None:
        if self.cfg.loggers:
            self.loggers = Loggers(
                list(self.cfg.loggers), self.out, self.cfg.id, msgspec.to_builtins(self.cfg)
            )

    def close(self) -> None:
        if self.loggers is not None:
            self.loggers.close()

    def record(self, row: dict[str, Any]) -> None:
        """A row of metrics.jsonl (a step's or an evaluation's), and to the loggers."""
        append_jsonl(self.out / "metrics.jsonl", row)
        if self.loggers is not None:
            self.loggers.log(row)

    def response_stats(
        self, batch: list[Group], env_failed: int, reward_failed: int
    ) -> dict[str, float | int]:
        """Response length, the share cut at max_tokens, the reward's extras (means)."""
        lengths = [len(r) for g in batch for r in g.responses]
        stop_ids = self.recipe.stop_token_ids if self.recipe is not None else []
        cut = [
            truncated(r, self.cfg.rollout.max_tokens, stop_ids) for g in batch for r in g.responses
        ]
        stats: dict[str, float | int] = {"response_tokens": sum(lengths) / len(lengths)}
        extras: dict[str, list[float]] = {}
        figures: dict[str, list[float]] = {}  # env episodes' turns, env seconds, ...
        for g in batch:
            for name, values in g.reward_extras.items():
                extras.setdefault(name, []).extend(values)
            for name, values in g.episodes.items():
                figures.setdefault(name, []).extend(values)
        if figures:  # an episode's length is every turn's: cut at max_tokens means nothing
            stats.update(episode_stats(figures))
            stats["env_failed"] = env_failed
        else:
            stats["truncated"] = sum(cut) / len(cut)
        means = {f"reward/{k}": finite_mean(v) for k, v in extras.items()}
        stats.update({k: v for k, v in means.items() if v == v})  # an extra never reported: none
        stats["reward_failed"] = reward_failed  # left out of their groups
        return stats

    def write_samples(self, batch: list[Group], version: int) -> None:
        """A few of the step's trajectories as text, with reward and weight-version lag."""
        rows: list[dict[str, Any]] = []
        for g in batch:
            for i, text in enumerate(g.response_texts):
                if len(rows) >= self.cfg.samples_per_step:
                    break
                rows.append(
                    {
                        "step": version + 1,
                        "prompt": g.prompt_text,
                        "response": text,
                        "reward": g.rewards[i],
                        "version_lag": version - min(g.versions[i], default=version),
                        "tokens": len(g.responses[i]),
                        "extras": {k: v[i] for k, v in g.reward_extras.items()},
                    }
                )
                if g.masks and self.recipe is not None:  # an episode: its turns, in order
                    rows[-1]["turns"] = turns_of(g.responses[i], g.masks[i], self.recipe.decode)
        for row in rows:
            append_jsonl(self.out / "samples.jsonl", row)


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One JSON line; a NaN (a mean of nothing) is written as null, which JSON has."""
    with open(path, "a") as fh:
        fh.write(json.dumps(_no_nan(row)) + "\n")


def _no_nan(value: Any) -> Any:
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def read_metrics(out: Path, pid: str, *, evals: bool = False) -> list[dict[str, Any]]:
    """A pipeline's step rows (``evals``: its evaluation rows, ``eval/...``), one per step."""
    path = out / pid / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written
    # a resumed pipeline repeats steps after its checkpoint: the latest wins
    key = "eval/reward" if evals else "reward"
    by_step = {r["step"]: r for r in rows if key in r}
    return [by_step[s] for s in sorted(by_step)]
