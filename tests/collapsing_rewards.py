"""A reward that collapses: 1 for the first `HIGH` samples scored in this process, 0 after (the local backend
scores in the driver's process). Tests reset `counter` before a run."""

import itertools

HIGH = 48
counter = itertools.count(1)


def first_high_then_zero(prompt: str, completion: str, sample: dict) -> float:
    return 1.0 if next(counter) <= HIGH else 0.0
