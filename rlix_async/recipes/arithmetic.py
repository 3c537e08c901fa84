"""The arithmetic recipe's dataset: sums as chat prompts with an ``answer`` field.

    python -m rlix_async.recipes.arithmetic [--out DIR] [--digits A B] [--train N] [--eval N]

``train.jsonl`` and ``eval.jsonl`` (no sum in both): "What is 7 + 4? Answer with just
the number." with ``answer: 11``. The recipe (``arithmetic.yaml`` beside this file)
uses one-digit sums, 60 for training (repeated to 3,000 rows) and 40 held out:
SmolLM2-135M-Instruct gets 70% of them right greedily and 40% sampled at T = 0.7, so
there is both a signal to learn from and room to learn. Two-digit sums start near 5%:
too little signal for a 135M model to learn from in minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

from rlix_async.rollout.dataset import write_splits

QUESTION = "What is {a} + {b}? Answer with just the number."
DIGITS = (1, 1)
TRAIN_ROWS = 3000
EVAL_ROWS = 40


def numbers(digits: int) -> range:
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def write_data(
    out: Path,
    digits: tuple[int, int] = DIGITS,
    train_rows: int = TRAIN_ROWS,
    eval_rows: int = EVAL_ROWS,
    seed: int = 0,
) -> tuple[Path, Path]:
    """Write ``out/train.jsonl`` and ``out/eval.jsonl``; the same arguments always give
    the same files. Returns their paths."""
    pairs = [(a, b) for a in numbers(digits[0]) for b in numbers(digits[1])]
    rng = random.Random(seed)
    rng.shuffle(pairs)
    held_out, rest = pairs[:eval_rows], pairs[eval_rows:]
    if not rest:
        raise ValueError(f"only {len(pairs)} distinct sums: fewer eval rows or more digits")
    train = [rest[i % len(rest)] for i in range(train_rows)]  # repeats when too few
    rng.shuffle(train)

    def rows(pairs: list[tuple[int, int]]) -> list[dict[str, object]]:
        return [{"prompt": QUESTION.format(a=a, b=b), "answer": a + b} for a, b in pairs]

    return write_splits(out, rows(train), rows(held_out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data"))
    ap.add_argument("--digits", type=int, nargs=2, default=list(DIGITS), metavar=("A", "B"))
    ap.add_argument("--train", type=int, default=TRAIN_ROWS)
    ap.add_argument("--eval", type=int, default=EVAL_ROWS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    try:
        train, held_out = write_data(args.out, tuple(args.digits), args.train, args.eval, args.seed)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(f"wrote {train} ({args.train} rows) and {held_out} ({args.eval} rows)")


if __name__ == "__main__":
    main()
