"""Reward scoring in Ray tasks, so a slow reward function never blocks the driver or the rollout actors."""

from __future__ import annotations

from typing import Literal

import ray
from ray.exceptions import RayTaskError

from distrl.config import RewardConfig
from distrl.workers.rewards import RewardError, score_batch

Item = tuple[str, str, dict]
"""(prompt text, completion text, dataset row)."""


@ray.remote
def _score(spec: str, items: list[Item], on_error: Literal["raise", "zero"], first_index: int,
           ) -> tuple[list[float], int]:
    return score_batch(spec, items, on_error, first_index)


def submit(cfg: RewardConfig, items: list[Item], first_index: int = 0) -> list[ray.ObjectRef]:
    """Start scoring `items` (rows `first_index`... of the step's batch, for error messages) in tasks of
    `cfg.batch_per_task` samples; returns their refs in order."""
    task = _score.options(num_cpus=cfg.num_cpus, max_retries=0)
    return [task.remote(cfg.function, items[i : i + cfg.batch_per_task], cfg.on_error, first_index + i)
            for i in range(0, len(items), cfg.batch_per_task)]


def collect(refs: list[ray.ObjectRef]) -> tuple[list[float], int]:
    """(rewards in submission order, number of samples whose reward function raised and were scored 0).

    Every task is awaited before an error is raised, so no failed task is left unretrieved (Ray would log each
    one again as an unhandled error). A RewardError comes back as itself, with the remote traceback appended
    (Ray does not carry `__cause__` across processes)."""
    rewards: list[float] = []
    errors = 0
    failure: RayTaskError | None = None
    for ref in refs:
        try:
            scores, n_errors = ray.get(ref)
        except RayTaskError as err:
            failure = failure or err
            continue
        rewards += scores
        errors += n_errors
    if failure is None:
        return rewards, errors
    if isinstance(failure.cause, RewardError):
        raise RewardError(f"{failure.cause.args[0]}\n\nremote traceback:\n{failure}") from None
    raise failure
