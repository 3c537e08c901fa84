"""Write the arithmetic recipe's dataset: sums as chat prompts with an ``answer`` field.

    python examples/recipes/arithmetic/make_data.py [--out DIR] [--digits A B] [--seed S]

``train.jsonl`` (3,000 rows) and ``eval.jsonl`` (200 rows, none of them in train):
"What is 7 + 48? Answer with just the number." with ``answer: 55``. ``--digits 1 2``
(the default) adds a one-digit and a two-digit number: SmolLM2-135M-Instruct gets
some of these right, so there is both a signal to learn from and room to learn.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTION = "What is {a} + {b}? Answer with just the number."


def numbers(digits: int) -> range:
    return range(0 if digits == 1 else 10 ** (digits - 1), 10**digits)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data")
    ap.add_argument("--digits", type=int, nargs=2, default=[1, 2], metavar=("A", "B"))
    ap.add_argument("--train", type=int, default=3000)
    ap.add_argument("--eval", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    pairs = [(a, b) for a in numbers(args.digits[0]) for b in numbers(args.digits[1])]
    rng = random.Random(args.seed)
    rng.shuffle(pairs)
    held_out, rest = pairs[: args.eval], pairs[args.eval :]
    if not rest:
        raise SystemExit(f"only {len(pairs)} distinct sums: lower --eval or add digits")
    train = [rest[i % len(rest)] for i in range(args.train)]  # repeats when too few
    rng.shuffle(train)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", held_out)):
        with open(args.out / f"{name}.jsonl", "w") as fh:
            for a, b in rows:
                fh.write(json.dumps({"prompt": QUESTION.format(a=a, b=b), "answer": a + b}) + "\n")
    print(f"wrote {len(train)} train and {len(held_out)} eval rows under {args.out}")


if __name__ == "__main__":
    main()
