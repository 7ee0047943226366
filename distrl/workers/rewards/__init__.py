"""Reward functions and the one place that calls them: the built-ins (`builtin.py`, `answers.py`) and scoring
(`scoring.py`), under the names configs give them (`reward.function: distrl.workers.rewards:exact_match`).

A reward function is `(prompt: str, completion: str, sample: dict) -> float`, where `sample` is the dataset row
(the reference answer sits under the data's `answer_key`; the built-ins read `sample["answer"]`). It may return a
mapping instead, `{"reward": float, ...}`, whose other (JSON-serialisable) keys are the sample's info: what answer
was extracted, what could not be (`math_answer` does so; evaluation writes the info with each sample and takes
`info["answer"]` for majority votes). Config names it as `package.module:function`; `resolve_reward` imports it
and `score_batch` scores a list of samples with it.
Plain Python: the Ray task that runs `score_batch` lives in `distrl.cluster.rewards`.
"""

from distrl.tasks.toy import toy_reward as toy
from distrl.workers.rewards.builtin import (
    NUMERIC_TOLERANCE,
    exact_match,
    extract_number,
    final_answer,
    math_answer,
    numeric_answer,
)
from distrl.workers.rewards.scoring import RewardError, RewardFn, Scores, resolve_reward, reward_and_info, score_batch

__all__ = ["NUMERIC_TOLERANCE", "RewardError", "RewardFn", "Scores", "exact_match", "extract_number", "final_answer",
           "math_answer", "numeric_answer", "resolve_reward", "reward_and_info", "score_batch", "toy"]
