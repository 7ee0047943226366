"""Reward scoring in tasks (Ray tasks, or plain calls on the local backend), so a slow reward function never
blocks the driver or the rollout actors."""

from __future__ import annotations

from typing import Any

from distrl.cluster.backend import Backend
from distrl.config import RewardConfig
from distrl.workers.rewards import RewardError, Scores, score_batch

Item = tuple[str, str, dict]
"""(prompt text, completion text, dataset row)."""


def submit(backend: Backend, cfg: RewardConfig, items: list[Item], first_index: int = 0) -> list[Any]:
    """Start scoring `items` (rows `first_index`... of the step's batch, for error messages) in tasks of
    `cfg.batch_per_task` samples; returns their handles in order."""
    return [backend.task(score_batch, cfg.function, items[i : i + cfg.batch_per_task], cfg.on_error,
                         first_index + i, num_cpus=cfg.num_cpus, max_retries=cfg.max_retries)
            for i in range(0, len(items), cfg.batch_per_task)]


def collect(backend: Backend, handles: list[Any]) -> Scores:
    """The tasks' scores in submission order (rewards, infos, how many samples failed in the reward function and
    were scored 0, the last failure's message).

    Every task is awaited before an error is raised, so no failed task is left unretrieved (Ray would log each
    one again as an unhandled error). A RewardError comes back as itself, with the remote traceback appended
    (Ray does not carry `__cause__` across processes)."""
    parts: list[Scores] = []
    failure: Exception | None = None
    for handle in handles:
        try:
            parts.append(backend.get(handle))
        except Exception as err:  # noqa: BLE001 - kept, and raised once every task is retrieved
            failure = failure or err
    if failure is None:
        return Scores.concat(parts)
    cause = getattr(failure, "cause", failure)  # a Ray task error wraps the exception the task raised
    if isinstance(cause, RewardError) and cause is not failure:
        raise RewardError(f"{cause.args[0]}\n\nremote traceback:\n{failure}") from None
    raise failure


def check_failures(failed: int, scored: int, last: str | None, cfg: RewardConfig, step: int) -> None:
    """Stop the run when more than `cfg.max_error_frac` of the `scored` samples scored for step `step` (kept,
    filtered or dropped as stale alike) failed in the reward function (`on_error: zero` scored `failed` of them 0):
    raises RewardError with the last failure, `last`."""
    if failed > cfg.max_error_frac * scored:
        raise RewardError(
            f"{failed} of the {scored} samples scored for step {step} failed in the reward function and were scored "
            f"0 (reward.on_error: zero), more than reward.max_error_frac = {cfg.max_error_frac}: the function looks "
            f"broken, so the run stops rather than train on zeros. The last failure: {last}")
