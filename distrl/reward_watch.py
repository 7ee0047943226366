"""A run whose reward collapsed says so: the mean reward, smoothed over `window` steps, fallen to `fraction` of the
best smoothed mean the run has reached and staying there `steps` steps in a row (`run.reward_collapse`).

A reward falling that far is rarely a harder task; far more often the policy broke (a learning rate too large for
the model: LoRA adapters at 1e-2 took a warm-started model's reward from 0.21 to 0 within 60 steps, docs/lora.md),
and every step after it trains a worse model. The watch only reports: the loop prints the warning and logs the
figures in every row (`health/reward_vs_best`, `health/reward_collapsed`). Bookkeeping over the rows' `reward/mean`
alone, so a resumed or recovered run rebuilds it from the rows it kept.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable

from distrl.config.collapse import RewardCollapseConfig


class RewardWatch:
    """Fed each step's `reward/mean` in step order (`rewards`: the rows already logged, to continue from)."""

    def __init__(self, cfg: RewardCollapseConfig, rewards: Iterable[float] = ()):
        self.cfg = cfg
        self.recent: deque[float] = deque(maxlen=cfg.window)
        self.best: float | None = None  # the best full-window mean so far
        self.below = 0  # steps in a row at or below `fraction` of the best
        for reward in rewards:
            self.observe(reward)

    def observe(self, reward: float) -> tuple[dict[str, float | None], str | None]:
        """Take one step's mean reward. Returns the row's figures (`health/reward_vs_best`: the smoothed mean over
        the best, null until a full window with a positive best; `health/reward_collapsed`: 1 while collapsed) and
        a warning on the step the run is found collapsed (again after a recovery and a new fall)."""
        self.recent.append(reward)
        if len(self.recent) < self.cfg.window:
            return {"health/reward_vs_best": None, "health/reward_collapsed": 0.0}, None
        smoothed = statistics.fmean(self.recent)
        self.best = smoothed if self.best is None else max(self.best, smoothed)
        if self.best <= 0:  # nothing positive to fall from
            return {"health/reward_vs_best": None, "health/reward_collapsed": 0.0}, None
        ratio = smoothed / self.best
        self.below = self.below + 1 if ratio <= self.cfg.fraction else 0
        warning = None
        if self.below == self.cfg.steps:
            warning = (f"the mean reward collapsed: {smoothed:.3f} over the last {self.cfg.window} steps is "
                       f"{ratio:.0%} of the best, {self.best:.3f}, and has been at most "
                       f"{self.cfg.fraction:.0%} of it for {self.cfg.steps} steps. Training on is unlikely to bring "
                       f"it back: look at the learning rate (too large for this model or for LoRA adapters?), "
                       f"kl/ref and the samples (RUN_DIR/samples); run.reward_collapse sets this watch")
        return {"health/reward_vs_best": ratio,
                "health/reward_collapsed": float(self.below >= self.cfg.steps)}, warning
