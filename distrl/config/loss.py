"""`loss`: the policy objective (PPO, GSPO, CISPO, SAPO, GMPO, GPG, Clip-Cov or KL-Cov, told apart by `type`:
`distrl.config.policy`), the KL term (in the loss or in the reward, told apart by `target`), the entropy bonus and
the rollout correction (`distrl.config.correction`).

Every term is aggregated the same way (`distrl.algo.compute_loss`), so the aggregation belongs to the objective: a
per-token loss chooses it; GSPO and GMPO are sequence-level, their every term the mean over sequences of a
per-sequence token mean, so they have none to choose (nor a dual clip, which caps per-token terms).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from distrl.config.base import Section, Variants, refuse_moved
from distrl.config.correction import CorrectionConfig
from distrl.config.policy import POLICY, PolicyConfig, PPOConfig

__all__ = ["KL", "POLICY", "KLConfig", "KLInLoss", "KLInReward", "LossConfig", "PolicyConfig"]

class KLInLoss(Section):
    target: Literal["loss"] = "loss"
    """Add coef * KL(pi || pi_ref) to the loss, aggregated like the policy term (GRPO, arXiv 2402.03300)."""
    coef: float = Field(default=0.0, ge=0.0)
    """Weight beta of the KL term; 0 disables it (and the reference actor)."""
    estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    """Per-token estimator of KL(pi || pi_ref) (Schulman 2020); `k3+` is k3's value with k2's gradient."""


class KLInReward(Section):
    target: Literal["reward"] = "reward"
    """Subtract coef * sum_t KL_t(pi_old || pi_ref) from each sequence's score before advantages (verl's
    `use_kl_in_reward`). No gradient flows through it, so `k3+` (which only changes gradients) is not offered."""
    coef: float = Field(default=0.0, ge=0.0)
    """Weight beta of the penalty; 0 disables it (and the reference actor)."""
    estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token estimator of the penalty (Schulman 2020)."""


KL = Variants("target", "loss", {"loss": KLInLoss, "reward": KLInReward})
KLConfig = Annotated[KLInLoss | KLInReward, Field(discriminator="target"), KL.shorthand]
"""`loss.kl: reward` is shorthand for `{target: reward}` (coef 0 until set)."""


class LossConfig(Section):
    policy: PolicyConfig = Field(default_factory=PPOConfig)
    """The policy objective: `ppo` (the default), `gspo`, `cispo`, `sapo`, `gmpo`, `gpg`, `clip_cov` or `kl_cov`
    (`docs/objective.md` says which to reach for when). A per-token one also chooses how every term is aggregated;
    `gspo` and `gmpo` are sequence-level."""
    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the entropy bonus (subtracted from the loss)."""
    kl: KLConfig = Field(default_factory=KLInLoss)
    """KL to the reference model: `target: loss` (a term of the loss) or `target: reward` (a penalty on scores)."""
    correction: CorrectionConfig | None = None
    """Rollout/trainer importance-sampling correction (`mode: tis | icepop | seq_mask_tis`); null disables it."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        ppo_only = "a field of the per-token objectives (not of gspo or gmpo, which are sequence-level): write "
        return refuse_moved(data, "loss", {
            "clip_low": "loss.policy.clip_low: write `loss.policy: {{type: ppo, clip_low: {value}}}` (gspo has its "
                        "own default)",
            "clip_high": "loss.policy.clip_high: write `loss.policy: {{type: ppo, clip_high: {value}}}` (gspo has "
                         "its own default)",
            "dual_clip": "loss.policy.dual_clip, a field of the ppo and clip_cov objectives: write `loss.policy: "
                         "{{type: ppo, dual_clip: {value}}}`",
            "aggregation": "loss.policy.aggregation, " + ppo_only + "`loss.policy: {{type: ppo, aggregation: "
                           "{value}}}`, or leave it out with gspo or gmpo, which always aggregate seq_mean_token_mean",
            "norm_len": "loss.policy.norm_len, " + ppo_only + "`loss.policy: {{type: ppo, aggregation: "
                        "seq_mean_token_sum_norm, norm_len: {value}}}`",
        })
