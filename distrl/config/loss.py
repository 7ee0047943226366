"""`loss`: the policy objective (PPO or GSPO, told apart by `type`), the KL term (in the loss or in the reward, told
apart by `target`), the entropy bonus and the rollout correction (`distrl.config.correction`).

Every term is aggregated the same way (`distrl.algo.compute_loss`), so the aggregation belongs to the objective:
PPO chooses it; GSPO is sequence-level, its every term the mean over sequences of a per-sequence token mean, so it
has none to choose (nor a dual clip, which caps per-token terms).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from distrl.config.base import Section, Variants, refuse_moved
from distrl.config.correction import CorrectionConfig

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


class PPOConfig(Section):
    type: Literal["ppo"] = "ppo"
    """Per-token ratio pi / pi_old, clipped (Schulman et al. 2017, arXiv 1707.06347)."""
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0.0)
    """Ratio is clipped above at 1 + clip_high (DAPO's clip-higher sets it above clip_low)."""
    dual_clip: float | None = Field(default=None, gt=1.0)
    """Dual-clip constant c > 1: for A < 0 the per-token loss is capped at -c A (Ye et al. 2020). Null disables."""
    aggregation: Aggregation = "token_mean"
    """How the per-token terms (policy, KL, entropy) become one scalar: token_mean (DAPO), seq_mean_token_mean
    (GRPO), seq_mean_token_sum, seq_mean_token_sum_norm (Dr. GRPO: per-sequence sums over a constant `norm_len`)."""
    norm_len: int | None = Field(default=None, gt=0)
    """Constant divisor of seq_mean_token_sum_norm; null means the most tokens a sample can train on
    (`rollout.sampling.max_new_tokens`, or with an `env` section `env.max_turns` turns of it, at most
    `env.max_tokens`)."""


class GSPOConfig(Section):
    type: Literal["gspo"] = "gspo"
    """One length-normalised ratio per sequence, (pi(o) / pi_old(o))^(1/|o|), clipped (Zheng et al. 2025,
    arXiv 2507.18071)."""
    clip_low: float = Field(default=3e-4, ge=0.0, lt=1.0)
    """Ratio is clipped below at 1 - clip_low. The paper's 3e-4: a geometric mean over a sequence strays far less
    from 1 than a token's ratio."""
    clip_high: float = Field(default=4e-4, ge=0.0)
    """Ratio is clipped above at 1 + clip_high (the paper's 4e-4)."""
    aggregation: ClassVar[Aggregation] = "seq_mean_token_mean"
    """Sequence-level: with one ratio and one advantage per sequence, the mean over sequences of per-sequence token
    means is the paper's objective; any other aggregation would weight sequences by their length."""
    norm_len: ClassVar[None] = None
    """seq_mean_token_sum_norm is not GSPO's, so there is no divisor."""
    dual_clip: ClassVar[None] = None
    """No dual clip: the sequence ratio is already clipped tightly."""


POLICY = Variants("type", "ppo", {"ppo": PPOConfig, "gspo": GSPOConfig})
PolicyConfig = Annotated[PPOConfig | GSPOConfig, Field(discriminator="type"), POLICY.shorthand]
"""`loss.policy: gspo` is shorthand for `{type: gspo}` (the paper's clip range)."""


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
    """The clipped policy objective: `ppo` (per-token ratio; it also chooses how every term is aggregated) or
    `gspo` (per-sequence ratio, sequence-level aggregation)."""
    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the entropy bonus (subtracted from the loss)."""
    kl: KLConfig = Field(default_factory=KLInLoss)
    """KL to the reference model: `target: loss` (a term of the loss) or `target: reward` (a penalty on scores)."""
    correction: CorrectionConfig | None = None
    """Rollout/trainer importance-sampling correction (`mode: tis | icepop | seq_mask_tis`); null disables it."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        ppo_only = "a field of the ppo objective only (gspo is sequence-level): write "
        return refuse_moved(data, "loss", {
            "clip_low": "loss.policy.clip_low: write `loss.policy: {{type: ppo, clip_low: {value}}}` (gspo has its "
                        "own default)",
            "clip_high": "loss.policy.clip_high: write `loss.policy: {{type: ppo, clip_high: {value}}}` (gspo has "
                         "its own default)",
            "dual_clip": "loss.policy.dual_clip, " + ppo_only + "`loss.policy: {{type: ppo, dual_clip: {value}}}`",
            "aggregation": "loss.policy.aggregation, " + ppo_only + "`loss.policy: {{type: ppo, aggregation: "
                           "{value}}}`, or leave it out with gspo, which always aggregates seq_mean_token_mean",
            "norm_len": "loss.policy.norm_len, " + ppo_only + "`loss.policy: {{type: ppo, aggregation: "
                        "seq_mean_token_sum_norm, norm_len: {value}}}`",
        })
