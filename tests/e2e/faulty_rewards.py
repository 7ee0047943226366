"""Reward functions that misbehave, for the error-path tests (imported by Ray reward tasks by spec)."""


def always_raises(prompt: str, completion: str, sample: dict) -> float:
    raise ZeroDivisionError("this reward function always fails")
