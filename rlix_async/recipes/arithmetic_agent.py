"""The arithmetic agent recipe: sums answered with a checker's feedback between turns,
as an agent written against the OpenAI API (``agent_api``).

    rlix-async demo --recipe arithmetic_agent

The task is the arithmetic recipe's (one-digit sums, the same data), but an episode is
a conversation: the model answers; a wrong answer is told so ("No, 9 is wrong. Try
again: ...") and the model answers again, up to ``attempts`` answers. Reward 1 if an
answer is right (correctness only, no format credit, in training and in the greedy
held-out evaluation alike), else 0. Each episode also reports ``first_correct`` (the
first answer was right), ``after_feedback`` (right only after being told it was
wrong) and ``attempts``; the evaluation's rows carry them as ``eval/<name>``.

Why this task: GRPO needs signal from the first step. SmolLM2-135M-Instruct, measured
on 64 sums with vLLM (docs/PERF.md): its first answer is right 56% greedily and 19%
sampled at T = 1; told it was wrong, it almost never corrects itself (0% greedily, it
repeats its answer; 4% sampled), so whatever it learns about using the feedback shows
in ``after_feedback``. Nothing here knows about token ids: the pipeline's server keeps
them (rollout/api_agents.py).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from rlix_async.recipes.arithmetic import QUESTION, numbers
from rlix_async.rollout.dataset import write_splits
from rlix_async.rollout.rewards import answers_equal, final_answer

RETRY = "No, {answer} is wrong. Try again: {question}"
NO_NUMBER = "Answer with just the number. {question}"


async def solve(row: dict[str, Any], client: Any, attempts: int = 3) -> dict[str, float]:
    """One episode: up to ``attempts`` answers, each wrong one told so."""
    question = str(row["prompt"])
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    for attempt in range(1, attempts + 1):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        answer = final_answer(text)
        if answer is not None and answers_equal(answer, row["answer"]):
            return {
                "reward": 1.0,
                "first_correct": float(attempt == 1),
                "after_feedback": float(attempt > 1),
                "attempts": float(attempt),
            }
        shown = answer if answer is not None else None
        feedback = NO_NUMBER if shown is None else RETRY
        messages.append(
            {"role": "user", "content": feedback.format(answer=shown, question=question)}
        )
    return {"reward": 0.0, "first_correct": 0.0, "after_feedback": 0.0, "attempts": attempts}


def write_data(
    out: Path, train_rows: int = 3000, eval_rows: int = 40, seed: int = 0
) -> tuple[Path, Path]:
    """``out/train.jsonl`` and ``out/eval.jsonl``: half one-digit sums (7 + 4), half a
    two-digit and a one-digit number (47 + 4), none in both splits, the eval split
    half of each. The same arguments always give the same files."""
    rng = random.Random(seed)
    kinds = []
    for digits in ((1, 1), (2, 1)):
        pairs = [(a, b) for a in numbers(digits[0]) for b in numbers(digits[1])]
        rng.shuffle(pairs)
        kinds.append((pairs[: eval_rows // 2], pairs[eval_rows // 2 :]))
    held_out = [p for kind, _ in kinds for p in kind]
    train = [kinds[i % 2][1][(i // 2) % len(kinds[i % 2][1])] for i in range(train_rows)]
    rng.shuffle(train)

    def rows(pairs: list[tuple[int, int]]) -> list[dict[str, object]]:
        return [{"prompt": QUESTION.format(a=a, b=b), "answer": a + b} for a, b in pairs]

    return write_splits(out, rows(train), rows(held_out))


def main() -> None:
    ap = argparse.ArgumentParser(description=write_data.__doc__)
    ap.add_argument("--out", type=Path, default=Path("data"))
    args = ap.parse_args()
    train, held_out = write_data(args.out)
    print(f"wrote {train} and {held_out}")


if __name__ == "__main__":
    main()
