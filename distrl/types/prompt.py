"""`Prompt`: one row of the prompt dataset, tokenized; what the driver hands rollout actors and reward tasks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One prompt of the dataset.

    `index` is the row's position in the dataset; `text` is the rendered prompt (chat template applied);
    `sample` is the raw row (answer and any extra fields), handed to the reward function.
    """

    index: int
    text: str
    prompt_ids: list[int]
    answer: str | None = None
    sample: dict[str, Any] = field(default_factory=dict)

    def row(self) -> dict[str, Any]:
        """The dataset row handed to reward functions and environments, with the answer under "answer" whatever
        `data.answer_key` is."""
        return self.sample if self.answer is None else {**self.sample, "answer": self.answer}
