"""A verifiers multi-turn environment as the Hub's packages write one, without tools: a `MultiTurnEnv` whose
`env_response` answers each guess with a user message ("Higher." / "Lower."), a stop condition of its own (the
number guessed), and a rubric of a reward function and a metric. Loaded by distrl as
`env_id: tests.standards.vf_guess`."""

from __future__ import annotations

import re

import verifiers as vf
from datasets import Dataset


def guess_of(text: str) -> int | None:
    """The first integer in `text`, or None."""
    found = re.search(r"-?\d+", text)
    return int(found.group()) if found else None


def last_guess(completion: list[dict]) -> int | None:
    replies = [m for m in completion if m["role"] == "assistant"]
    return guess_of(str(replies[-1].get("content") or "")) if replies else None


class GuessEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs) -> vf.Messages:
        guess, target = guess_of(str(messages[-1].get("content") or "")), int(state["answer"])
        hint = "Say a number." if guess is None else "Higher." if guess < target else "Lower."
        return [{"role": "user", "content": hint}]

    @vf.stop
    async def guessed(self, state: vf.State, **kwargs) -> bool:
        trajectory = state["trajectory"]
        return bool(trajectory) and last_guess(trajectory[-1]["completion"]) == int(state["answer"])


def load_environment(targets: tuple[int, ...] = (2, 4, 5), max_turns: int = 4) -> vf.Environment:
    rows = [{"question": "Guess my number, from 1 to 5.", "answer": str(t)} for t in targets]

    def correct(completion, answer, **kwargs) -> float:
        return 1.0 if last_guess(completion) == int(answer) else 0.0

    def guesses(completion, **kwargs) -> float:
        return float(sum(m["role"] == "assistant" for m in completion))

    rubric = vf.Rubric(funcs=[correct])
    rubric.add_metric(guesses)
    return GuessEnv(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=max_turns)
