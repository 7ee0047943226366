"""A verifiers tool environment as the Hub's packages write one: a `ToolEnv` whose tool is a typed Python function
(verifiers turns its signature and docstring into the tool's schema), scored by whether the final answer is the
row's. Loaded by distrl as `env_id: tests.standards.vf_tools`."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def load_environment(count: int = 8, max_turns: int = 3) -> vf.Environment:
    rows = [{"question": f"Use the add tool: what is {a} + 3?", "answer": str(a + 3)} for a in range(count)]

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if answer in str(completion[-1].get("content") or "") else 0.0

    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], max_turns=max_turns,
                      rubric=vf.Rubric(funcs=[correct_answer]))
