"""The reward of `bench/bench_long_tail.py`'s task: prompts that ask for an answer of a stated number of words.

Imported by the reward tasks from this directory (the bench puts it on PYTHONPATH).
"""

from __future__ import annotations


def stated_length(prompt: str, completion: str, sample: dict) -> float:
    """How close the completion's length in words (n) is to the length the prompt asked for (`sample["words"]`, L):
    min(n, L) / max(n, L), 1 at the asked length and falling on either side: 2 words asked 4 and 8 words both
    score 0.5, 40 words 0.1. Every extra word costs something however long the answer (a reward that were 0 past
    some length would give no direction to a group of answers all past it)."""
    asked, n = int(sample["words"]), len(completion.split())
    return min(n, asked) / max(n, asked)
