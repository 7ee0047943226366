"""A 0/1 reward for tests of dynamic sampling: many groups of a random model score all 0 or all 1."""


def has_digit(prompt: str, completion: str, sample: dict) -> float:
    return float(any(c.isdigit() for c in completion))
