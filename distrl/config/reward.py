"""`reward`: the reward function and how its tasks run and fail."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distrl.config.base import Section


class RewardConfig(Section):
    function: str = "distrl.workers.rewards:exact_match"
    """Reward function `package.module:function` with signature (prompt, completion, sample) -> float."""
    on_error: Literal["raise", "zero"] = "raise"
    """A reward function that raises or returns a non-finite or non-numeric value fails the run (`raise`, naming
    the function and the sample) or scores that sample 0 and counts it in `reward/errors` (`zero`)."""
    max_error_frac: float = Field(default=0.5, gt=0.0, le=1.0)
    """With `on_error: zero`, a step in which more than this fraction of the samples failed stops the run with the
    last error: the function is broken, and training on zeros would only hide it (1.0: never stop)."""
    num_cpus: float = Field(default=0.25, gt=0.0)
    """CPUs reserved by each reward task."""
    batch_per_task: int = Field(default=64, gt=0)
    """Samples scored per Ray task."""
    max_retries: int = Field(default=3, ge=0)
    """Times a reward task is run again when its process dies (killed, out of memory, node lost). An exception
    raised by the reward function is not an infrastructure failure: `on_error` decides what happens to it."""
