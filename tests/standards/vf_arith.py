"""A verifiers environment as the Environments Hub's packages write one: `load_environment()` returns a
`SingleTurnEnv` over its own data set, with a system prompt, an XML parser and a rubric of two weighted reward
functions and a metric. Loaded by distrl as `env_id: tests.standards.vf_arith`."""

from __future__ import annotations

import verifiers as vf
from datasets import Dataset


def load_environment(count: int = 8, offset: int = 0) -> vf.Environment:
    rows = [{"question": f"What is {a} + {a + 1}?", "answer": str(2 * a + 1)} for a in range(offset, offset + count)]
    parser = vf.XMLParser(["answer"], answer_field="answer")

    def correct_answer(completion, answer, **kwargs) -> float:
        return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0

    def length(completion, **kwargs) -> float:
        return float(len(completion[-1]["content"]))

    rubric = vf.Rubric(funcs=[correct_answer, parser.get_format_reward_func()], weights=[1.0, 0.2], parser=parser)
    rubric.add_metric(length)
    return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), eval_dataset=Dataset.from_list(rows[:2]),
                            system_prompt="Answer between <answer> and </answer>.", parser=parser, rubric=rubric)
