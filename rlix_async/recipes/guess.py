"""The guessing-game recipe: "higher" or "lower" until the model finds the number.

    python -m rlix_async.recipes.guess [--out DIR] [--train N] [--eval N] [--high H]

Multi-turn by nature: an episode lasts as many turns as the model needs. Each game's
range 1..high is drawn log-uniformly between 1..2 and 1..H, so most games are small
and a few are large: a bisecting player needs about log2(high) turns, a careless one
about high / 2, up to ``max_turns``. Episode lengths are heavy-tailed: the long-tail
workload, where a few long episodes hold a pipeline's rollout shards while the rest
of the batch is done.
Reward 1 for finding the number, less 0.05 a turn after the first; 0 if
``max_turns`` ends the episode first. A turn with no number gets a reminder.
"""

from __future__ import annotations

import argparse
import math
import random
from pathlib import Path
from typing import Any

from rlix_async.rollout.dataset import write_splits
from rlix_async.rollout.episodes import StepResult
from rlix_async.rollout.rewards import final_answer

RULES = (
    "I am thinking of a whole number from {low} to {high}. Guess it: answer with just a "
    "number. After each guess I say higher or lower."
)
TURN_COST = 0.05
TRAIN_ROWS = 2000
EVAL_ROWS = 32
HIGH = 128


class GuessNumber:
    """One game on one row (``target``, ``low``, ``high``). Plain methods: the pipeline
    runs them in threads."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.target, self.low, self.high = int(row["target"]), int(row["low"]), int(row["high"])
        self.guesses = 0

    def reset(self) -> str:
        return RULES.format(low=self.low, high=self.high)

    def step(self, action: str) -> StepResult:
        answer = final_answer(action)
        try:
            guess = int(float(answer)) if answer is not None else None
        except (ValueError, OverflowError):  # \\boxed{inf}, 1e999: not a guess
            guess = None
        if guess is None:
            return StepResult("Answer with just a number.", 0.0, False)
        self.guesses += 1
        if guess == self.target:
            reward = max(1.0 - TURN_COST * (self.guesses - 1), 0.1)
            return StepResult(None, reward, True, {"guesses": self.guesses})
        return StepResult("higher" if guess < self.target else "lower", 0.0, False)


def write_data(
    out: Path,
    train_rows: int = TRAIN_ROWS,
    eval_rows: int = EVAL_ROWS,
    high: int = HIGH,
    seed: int = 0,
) -> tuple[Path, Path]:
    """``out/train.jsonl`` and ``out/eval.jsonl``: the same arguments, the same files.
    The ``question`` field names the game (the dataset's prompt key); the env reads the rest."""
    if high < 2:
        raise ValueError(f"high {high}: a game needs at least two numbers")
    rng = random.Random(seed)

    def row() -> dict[str, object]:
        top = round(2 ** rng.uniform(1, math.log2(high)))  # log-uniform: the heavy tail
        return {"question": f"guess 1..{top}", "target": rng.randint(1, top), "low": 1, "high": top}

    def rows(n: int) -> list[dict[str, object]]:
        return [row() for _ in range(n)]

    train = rows(train_rows)  # drawn first: the same seed, the same files
    return write_splits(out, train, rows(eval_rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data"))
    ap.add_argument("--train", type=int, default=TRAIN_ROWS)
    ap.add_argument("--eval", type=int, default=EVAL_ROWS)
    ap.add_argument("--high", type=int, default=HIGH)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    train, held_out = write_data(args.out, args.train, args.eval, args.high, args.seed)
    print(f"wrote {train} and {held_out}")


if __name__ == "__main__":
    main()
