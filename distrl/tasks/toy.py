"""Toy counting task for the quickstart: "Continue counting: 17 18 19" -> "20".

The dataset asks for the next number of a short run; `answer` is that number, so `numeric_answer` scores the
task exactly. That exact reward is far too sparse for a random 2-layer model to learn in a few dozen steps,
so the quickstart trains on `toy_reward`, a dense shaping reward: the fraction of the response's visible
characters that are digits.

Why a random model learns it measurably within ~20-40 steps:
  * every response gets a graded score in [0, 1], not a 0/1 hit, so the samples of one group differ and
    group-relative advantages are non-zero from the first step;
  * the tiny model's tokenizer is trained on this task's text, so about a quarter of its vocabulary are number
    tokens (" 18", "19", ...) and a random model's responses are already ~30% digits;
  * raising the reward needs no reasoning about the prompt: shifting probability mass towards number tokens
    (largely a bias in the output layer) is enough, which policy-gradient steps do quickly.
Measured with on-policy GRPO on the tiny model (8 prompts x 8 samples, 16 new tokens, lr 1e-3): mean reward
0.30 over the first 5 steps, 0.72 over steps 26-30; with lr 3e-3 it reaches 0.99.
A rising `reward/mean` therefore shows that the whole loop (sampling, scoring, advantages, update, weight sync)
works, not that the model counts.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

TEMPLATES = (
    "Continue counting: {run}",
    "Count on: {run}",
    "Next number after {run}?",
    "What comes next: {run}",
)
"""Prompt phrasings; `{run}` is a few consecutive numbers separated by spaces."""


def make_row(rng: random.Random) -> dict[str, str]:
    """One `{"prompt", "answer"}` row: a run of 2-4 consecutive numbers and the number that follows it."""
    start, length = rng.randrange(0, 1000), rng.randrange(2, 5)
    run = " ".join(str(start + i) for i in range(length))
    return {"prompt": rng.choice(TEMPLATES).format(run=run), "answer": str(start + length)}


def write_toy_dataset(path: str | Path, n: int = 256, seed: int = 0) -> Path:
    """Write `n` rows of the counting task as JSON lines to `path`; same seed, same file."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(make_row(rng)) + "\n" for _ in range(n)))
    return path


def toy_corpus(n: int = 2000, seed: int = 0) -> list[str]:
    """Text of this task (prompts followed by their answers) for training the tiny model's tokenizer."""
    rng = random.Random(seed)
    rows = [make_row(rng) for _ in range(n)]
    return [f"{row['prompt']} {row['answer']}" for row in rows]


def toy_reward(prompt: str, completion: str, sample: dict) -> float:
    """Fraction of the completion's non-whitespace characters that are ASCII digits; 0 when there are none."""
    chars = [c for c in completion if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c in "0123456789" for c in chars) / len(chars)
