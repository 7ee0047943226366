"""The one place that calls reward functions: `resolve_reward` imports the one config names
(`package.module:function`), `score_batch` scores a list of samples with it, `reward_and_info` reads what it returned.
Plain Python: the Ray task that runs `score_batch` lives in `distrl.cluster.rewards`.
"""


from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from distrl.imports import import_spec

RewardFn = Callable[[str, str, dict], float | Mapping[str, Any]]

class RewardError(RuntimeError):
    """A reward function raised or returned a non-finite / non-numeric value (with `reward.on_error: raise`)."""


# ------------------------------------------------------------------------------------------------------ resolving
def resolve_reward(spec: str) -> RewardFn:
    """Import the reward function that `spec` (`package.module:function`) names."""
    fn = import_spec(spec, "reward function", "function", "distrl.workers.rewards:exact_match")
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


# -------------------------------------------------------------------------------------------------------- scoring
def _shorten(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def reward_and_info(value: object) -> tuple[float, dict[str, Any]]:
    """`value` as a finite float and the sample's info (a mapping's keys besides "reward"); anything else is the
    reward function's error."""
    info: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise TypeError(f"returned a mapping without a 'reward' key (keys: {sorted(value)})")
        info = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"returned a non-finite reward {value!r}")
    return float(value), info


@dataclass(frozen=True)
class Scores:
    """What scoring a list of samples gave: one reward and one info dict per sample, how many failed in the
    reward function (scored 0 under `on_error: zero`; their info holds the "error"), and the last failure."""

    rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    errors: int = 0
    last: str | None = None

    @staticmethod
    def concat(parts: list[Scores]) -> Scores:
        last = next((p.last for p in reversed(parts) if p.last), None)
        return Scores([r for p in parts for r in p.rewards], [i for p in parts for i in p.infos],
                      sum(p.errors for p in parts), last)


def score_batch(spec: str, items: list[tuple[str, str, dict]], on_error: Literal["raise", "zero"] = "raise",
                first_index: int = 0) -> Scores:
    """Score `(prompt, completion, sample)` items with the function `spec` names; errors call item i
    "sample first_index + i" (the driver numbers a run's samples prompt ticket x n + j).

    A failure is an exception or a non-finite / non-numeric return value: with `on_error="raise"` it raises
    `RewardError` naming the function and the sample, chained to the original error; with `"zero"` the item
    scores 0.0 and is counted.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
    fn = resolve_reward(spec)
    rewards: list[float] = []
    infos: list[dict[str, Any]] = []
    errors, last = 0, None
    for i, (prompt, completion, sample) in enumerate(items):
        try:
            reward, info = reward_and_info(fn(prompt, completion, sample))
        # A user's reward function may raise anything; `reward.on_error` is the policy that decides what happens.
        except Exception as err:
            message = (f"reward function {spec} failed on sample {first_index + i} (prompt {_shorten(prompt)}, "
                       f"completion {_shorten(completion)}): {type(err).__name__}: {err}")
            if on_error == "raise":
                raise RewardError(message) from err
            reward, info = 0.0, {"error": message}
            errors, last = errors + 1, message
        rewards.append(reward)
        infos.append(info)
    return Scores(rewards, infos, errors, last)


