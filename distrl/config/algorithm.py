"""`algorithm`: the advantage estimator and where the PPO ratio's old log-probs come from."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from distrl.config.base import Section

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")


class AlgorithmConfig(Section):
    model_config = ConfigDict(validate_by_name=True)  # `lambda` in YAML and --set, `lam` in Python

    advantage: AdvantageEstimator = "grpo"
    """Advantage estimator. `gae` needs a value model (critic)."""
    eps: float = Field(default=1e-6, gt=0.0)
    """Added to the standard deviation before dividing (grpo, whitening, reinforce_pp*)."""
    whitening: bool = False
    """Whiten the advantages over the whole step batch after the estimator: divide by the batch std (+ eps); the
    group estimators' batch mean is 0 already, GAE's token advantages have theirs removed first (as verl and
    OpenRLHF do; the returns the critic learns are not whitened). reinforce_pp and reinforce_pp_baseline always
    whiten; dr_grpo with whitening is reinforce_pp_baseline."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount over response tokens (token-level returns, GAE)."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0, alias="lambda")
    """GAE lambda (`lambda` in YAML and --set; `lam` in Python, as `lambda` is a keyword)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Where the PPO ratio's denominator comes from. `recompute`: the learner scores the batch before updating
    (decoupled PPO; the rollout correction then bridges rollout -> old). `rollout`: use vLLM's log-probs directly
    (bypass mode; cheaper, and the correction weights are then identically 1). When the update is one optimizer
    step (one mini-batch, one PPO epoch) and no KL in the reward needs them first, `recompute` takes them from the
    update's own forward pass, detached: the same weights give the same log-probs, without a second pass."""

    @model_validator(mode="after")
    def _checks(self) -> AlgorithmConfig:
        if self.whitening and self.advantage.startswith("reinforce_pp"):
            raise ValueError(f"algorithm.whitening is redundant with algorithm.advantage '{self.advantage}', which "
                             f"always whitens over the batch; leave whitening false")
        return self
