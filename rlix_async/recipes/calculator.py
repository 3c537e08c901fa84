"""The calculator recipe: a multi-turn environment with a tool, and its dataset.

    python -m rlix_async.recipes.calculator [--out DIR] [--train N] [--eval N]

The model may write ``<calc>expression</calc>`` in a turn; the environment replies
with the value (or why it could not compute it) and the episode goes on. A turn
with a number and no tool call is the final answer: the episode ends, reward 1 if
it equals the row's ``answer``. A turn with neither gets a reminder. Expressions are
computed by :func:`evaluate`, an AST walker over numbers, ``+ - * /`` and
parentheses, bounded in size: never ``eval``.

The data: two-digit products and sums ("What is 37 * 24?"), ``answer`` the value;
``train.jsonl`` and ``eval.jsonl`` share no question.
"""

from __future__ import annotations

import argparse
import ast
import operator
import random
import re
from pathlib import Path
from typing import Any

from rlix_async.rollout.dataset import write_splits
from rlix_async.rollout.episodes import StepResult
from rlix_async.rollout.rewards import answers_equal, final_answer

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_MAGNITUDE = 1e15
CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
INSTRUCTIONS = (
    "{question}\nYou have a calculator: write <calc>expression</calc> (numbers, + - * / "
    "and parentheses) and you get its value back. When you know the result, answer with "
    "just the number."
)
REMINDER = "Compute with <calc>expression</calc>, or answer with just the number."
TRAIN_ROWS = 2000
EVAL_ROWS = 40

_OPERATORS: dict[type[ast.AST], Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class CalcError(ValueError):
    """An expression the calculator does not compute: the reason, for the model."""


def evaluate(expression: str) -> int | float:
    """The value of ``expression``: numbers, ``+ - * /``, unary minus and parentheses."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # a lone surrogate, ...
        raise CalcError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalcError(f"more than {MAX_NODES} parts")
    value = _value(tree.body)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _value(node: ast.AST) -> int | float:
    number: int | float
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        if isinstance(node.value, bool):
            raise CalcError("only numbers, + - * / and parentheses")
        number = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        inner = _value(node.operand)
        number = -inner if isinstance(node.op, ast.USub) else inner
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise CalcError("division by zero")
        number = _OPERATORS[type(node.op)](left, right)
    else:
        raise CalcError("only numbers, + - * / and parentheses")
    if abs(number) > MAX_MAGNITUDE:
        raise CalcError("number too large")
    return number


def shown(value: int | float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


class Calculator:
    """One episode on one row (``question``, ``answer``). Plain methods: the pipeline
    runs them in threads."""

    def __init__(self, row: dict[str, Any], *, question_key: str = "question") -> None:
        self.question = str(row[question_key])
        self.answer = row["answer"]
        self.calls = 0

    def reset(self) -> str:
        return INSTRUCTIONS.format(question=self.question)

    def step(self, action: str) -> StepResult:
        call = CALL.search(action)
        if call is not None:
            self.calls += 1
            try:
                reply = f"<result>{shown(evaluate(call.group(1)))}</result>"
            except CalcError as exc:
                reply = f"<error>{exc}</error>"
            return StepResult(reply, 0.0, False, {"calls": self.calls})
        answer = final_answer(action)
        if answer is None:
            return StepResult(REMINDER, 0.0, False, {"calls": self.calls})
        correct = answers_equal(answer, self.answer)
        return StepResult(None, 1.0 if correct else 0.0, True, {"calls": self.calls})


def write_data(
    out: Path, train_rows: int = TRAIN_ROWS, eval_rows: int = EVAL_ROWS, seed: int = 0
) -> tuple[Path, Path]:
    """``out/train.jsonl`` and ``out/eval.jsonl``: the same arguments, the same files."""
    questions = [
        (f"What is {a} {op} {b}?", a * b if op == "*" else a + b)
        for a in range(11, 100)
        for b in range(11, 100)
        for op in ("*", "+")
    ]
    rng = random.Random(seed)
    rng.shuffle(questions)
    held_out, rest = questions[:eval_rows], questions[eval_rows : eval_rows + train_rows]

    def rows(items: list[tuple[str, int]]) -> list[dict[str, object]]:
        return [{"question": question, "answer": answer} for question, answer in items]

    return write_splits(out, rows(rest), rows(held_out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("data"))
    ap.add_argument("--train", type=int, default=TRAIN_ROWS)
    ap.add_argument("--eval", type=int, default=EVAL_ROWS)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    train, held_out = write_data(args.out, args.train, args.eval, args.seed)
    print(f"wrote {train} and {held_out}")


if __name__ == "__main__":
    main()
