"""The calculator recipe as an agent written against the OpenAI API (``agent_api``).

The same task and data as ``calculator.py`` (two-digit products and sums), but the
loop is an ordinary OpenAI tool-calling agent: the model gets a ``calc`` tool, each
call it makes is computed (by ``calculator.evaluate``, never ``eval``) and returned as
a tool message. A turn without a call is an answer: the first is sent back once for a
check (a reflection turn), and the answer after it scores, reward 1 if right. A turn
with neither a call nor a number gets a reminder. Nothing here knows about token
ids: the pipeline's server keeps them (rollout/api_agents.py).

    rlix-async demo --recipe calculator_api
"""

from __future__ import annotations

import json
from typing import Any

from rlix_async.recipes.calculator import REMINDER, CalcError, evaluate, shown
from rlix_async.rollout.rewards import answers_equal, final_answer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "The value of an arithmetic expression: numbers, + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
QUESTION = "{question}\nUse the calc tool if it helps. Then answer with just the number."
CHECK = "Check your answer (use the calc tool if it helps), then reply with just the number."


def run_call(arguments: str) -> str:
    """A ``calc`` call's result, or why there is none (for the model to read)."""
    try:
        args = json.loads(arguments)
        return shown(evaluate(str(args["expression"])))
    except (ValueError, KeyError, TypeError, CalcError) as exc:
        return f"error: {exc}"


async def solve(row: dict[str, Any], client: Any, max_turns: int = 4) -> dict[str, float]:
    """One episode: the agent's loop over chat completions with the ``calc`` tool. The
    model's first answer is checked once ("check it, then reply with just the number":
    a reflection turn, where it may still use the tool); the answer after that counts."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": QUESTION.format(question=row["question"])}
    ]
    calls = checked = 0
    for _ in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if message.tool_calls:
            for call in message.tool_calls:
                calls += 1
                result = run_call(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
            continue
        answer = final_answer(message.content or "")
        if checked and answer is not None:
            correct = answers_equal(answer, row["answer"])
            return {"reward": 1.0 if correct else 0.0, "calls": calls}
        checked = 1
        messages.append({"role": "user", "content": CHECK if answer is not None else REMINDER})
    return {"reward": 0.0, "calls": calls}
