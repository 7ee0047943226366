"""`run.reward_collapse`: when a run whose reward fell and stayed down says so."""

from __future__ import annotations

from pydantic import Field

from distrl.config.base import Section


class RewardCollapseConfig(Section):
    fraction: float = Field(default=0.5, gt=0.0, lt=1.0)
    """The run has collapsed once its smoothed mean reward is at or below this fraction of the best smoothed mean
    reward it has reached (for `steps` steps in a row). Watched once that best is above 0: a reward that is never
    positive has no fraction to fall to."""
    window: int = Field(default=5, gt=0)
    """Steps in the moving mean of `reward/mean` that is compared (one step's batch is noisy)."""
    steps: int = Field(default=5, gt=0)
    """Steps in a row the smoothed reward must stay at or below the fraction before the run warns."""
