"""The reward of `bench/bench_long_tail.py`'s task: prompts that ask for an answer of a stated number of words.

Imported by the reward tasks from this directory (the bench puts it on PYTHONPATH).
"""

from __future__ import annotations


def stated_length(prompt: str, completion: str, sample: dict) -> float:
    """How close the completion's length in words is to the length the prompt asked for (`sample["words"]`, L):
    max(0, 1 - |n - L| / L) for n words: 1 at the asked length, 0 at none or twice as many."""
    asked = int(sample["words"])
    return max(0.0, 1.0 - abs(len(completion.split()) - asked) / asked)
