"""Arithmetic problems for the calculator example, and the warm-start conversations that teach the tool's format.

A problem is a dataset row `{"prompt": 'What is "59 + 63"?', "answer": "122"}`: two 2-digit numbers and one of
+ - *, far too many for a 2-layer model to memorise, so an answer is right only when the model copies the quoted
expression into a calculator call and then the tool's result into its answer. The quotes make the expression's
tokens in the prompt the same as in the call (`"59 + 63"` in both), which makes copying learnable in a few
hundred steps.

The warm start teaches two behaviours on disjoint examples: call the calculator, then answer with its result
(`tool_frac` of them); or answer at once with a guess, a random number (wrong but for chance). The model then
calls the tool on somewhat fewer than `tool_frac` of the problems (0.38 for 0.5), and GRPO's reward (1 for the
right final answer) has a decision to learn: call the tool.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from distrl.agents.tools.calculator import evaluate, format_number

OPERATORS = ("+", "-", "*")


def make_problem(rng: random.Random) -> dict[str, str]:
    """One row: a quoted expression of two numbers in [10, 99] and its value."""
    a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice(OPERATORS)
    expression = f"{a} {op} {b}"
    return {"prompt": f'What is "{expression}"?', "answer": format_number(evaluate(expression))}


def make_splits(n_train: int, n_eval: int, seed: int) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Disjoint training and held-out problems (no expression in both)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    while len(rows) < n_train + n_eval:
        row = make_problem(rng)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows[:n_train], rows[n_train:]


def write_jsonl(rows: list[dict[str, Any]], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def expression_of(row: dict[str, str]) -> str:
    """The quoted expression of a row's prompt."""
    return row["prompt"].split('"')[1]


def conversation(row: dict[str, str], use_tool: bool, rng: random.Random) -> list[dict[str, Any]]:
    """The chat messages of one warm-start example: the question, then either a calculator call, its result and
    the answer, or a direct guess (a random number in the answers' range, -89..9801)."""
    question = {"role": "user", "content": row["prompt"]}
    if not use_tool:
        return [question, {"role": "assistant", "content": str(rng.randint(-89, 9801))}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression_of(row)}}}
    return [question, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": row["answer"]},
            {"role": "assistant", "content": row["answer"]}]
