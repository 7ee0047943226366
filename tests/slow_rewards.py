"""A reward that takes its time, so that a test can signal a run in the middle of a step."""

import time


def slow_toy(prompt: str, completion: str, sample: dict) -> float:
    time.sleep(0.25)
    return float(sum(c.isdigit() for c in completion)) / max(1, len(completion))
