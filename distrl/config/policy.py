"""`loss.policy`: the policy objective, one variant per loss (told apart by `type`), each with its paper's
parameters, defaults and constraints (the names are verl's where verl has the loss, the paper's symbol in the
docstring).

A per-token loss (ppo, cispo, sapo, gpg, clip_cov, kl_cov) chooses how its terms are aggregated, and that
aggregation is every term's (`distrl.algo.compute_loss`). A sequence-level loss (gspo, gmpo) is its paper's mean over
sequences of one term per sequence, so it has no aggregation, norm_len or dual clip to write: the config refuses
them, naming the field and the variants that have it.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from distrl.config.base import Section, Variants

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]

COVARIANCE_TYPES = ("clip_cov", "kl_cov")
"""The losses whose tokens are selected by covariance over the whole batch before it is split
(`distrl.algo.covariance_selection`): they need the old log-probs before the update."""

_AGGREGATION = (
    "How the per-token terms (policy, KL, entropy) become one scalar: token_mean (DAPO: over the batch's tokens), "
    "seq_mean_token_mean (GRPO: the mean over sequences of each one's token mean), seq_mean_token_sum (the mean over "
    "sequences of each one's token sum), seq_mean_token_sum_norm (Dr. GRPO: the sum over sequences of each one's "
    "token sum, divided by the number of sequences times `norm_len`).")
_NORM_LEN = (
    "Constant divisor of seq_mean_token_sum_norm (with the number of sequences); null means the most tokens a sample "
    "can train on (`rollout.sampling.max_new_tokens`, or with an `env` section `env.max_turns` turns of it, at most "
    "`env.max_tokens`).")


def _aggregation(default: Aggregation) -> Any:
    return Field(default=default, description=_AGGREGATION)


def _norm_len() -> Any:
    return Field(default=None, gt=0, description=_NORM_LEN)


class PPOConfig(Section):
    type: Literal["ppo"] = "ppo"
    """Per-token ratio pi / pi_old, clipped (Schulman et al. 2017, arXiv 1707.06347)."""
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0.0)
    """Ratio is clipped above at 1 + clip_high (DAPO's clip-higher sets it above clip_low)."""
    dual_clip: float | None = Field(default=None, gt=1.0)
    """Dual-clip constant c > 1: for A < 0 the per-token loss is capped at -c A (Ye et al. 2020). Null disables."""
    aggregation: Aggregation = _aggregation("token_mean")
    norm_len: int | None = _norm_len()


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


class CISPOConfig(Section):
    type: Literal["cispo"] = "cispo"
    """The clipped importance weight as a stop-gradient coefficient on A log pi, so that no token's gradient is
    dropped (CISPO, MiniMax-M1, arXiv 2506.13585; verl's `cispo`)."""
    clip_low: float | None = Field(default=None, ge=0.0)
    """epsilon_low^IS: the weight is clipped below at 1 - clip_low. Null, the paper's choice, sets no lower bound."""
    clip_high: float = Field(default=3.0, ge=0.0)
    """epsilon_high^IS: the weight is clipped above at 1 + clip_high. MiniMax-M1 tunes only this one and does not
    publish its value; 3.0 caps the weight at 4, Tinker's CISPO default (its documentation cites ScaleRL, arXiv
    2510.13786). verl's example uses 0.2."""
    aggregation: Aggregation = _aggregation("token_mean")
    norm_len: int | None = _norm_len()


class SAPOConfig(Section):
    type: Literal["sapo"] = "sapo"
    """A sigmoid gate of the ratio, sigma(tau (r - 1)) 4 / tau, in place of a hard clip: the gradient is attenuated
    smoothly as the ratio leaves 1 (Soft Adaptive Policy Optimization, Qwen, arXiv 2511.20347; verl's `sapo`)."""
    tau_pos: float = Field(default=1.0, gt=0.0)
    """Gate temperature tau_pos of tokens with a positive advantage (the paper's 1.0): higher, the gradient decays
    faster away from r = 1."""
    tau_neg: float = Field(default=1.05, gt=0.0)
    """Gate temperature tau_neg of tokens with a zero or negative advantage (the paper's 1.05). The paper recommends
    tau_neg > tau_pos: a negative advantage raises the logits of many unsampled tokens, which destabilises more."""
    aggregation: Aggregation = _aggregation("seq_mean_token_mean")
    norm_len: int | None = _norm_len()


class GMPOConfig(Section):
    type: Literal["gmpo"] = "gmpo"
    """The geometric mean of a sequence's token ratios, each clipped in log space, as the sequence's ratio
    (Geometric-Mean Policy Optimization, arXiv 2507.20673; verl's `geo_mean`)."""
    clip_low: float = Field(default=0.4, ge=0.0)
    """A token's log-ratio is clipped below at -clip_low (for A < 0; the paper's ratio range (e^-0.4, e^0.4))."""
    clip_high: float = Field(default=0.4, ge=0.0)
    """A token's log-ratio is clipped above at clip_high (for A > 0; the paper's 0.4)."""
    aggregation: ClassVar[Aggregation] = "seq_mean_token_mean"
    """Sequence-level: the paper's objective is the mean over sequences of A_i times the sequence's geometric-mean
    ratio; any other aggregation would weight sequences by their length."""
    norm_len: ClassVar[None] = None
    """seq_mean_token_sum_norm is not GMPO's, so there is no divisor."""
    dual_clip: ClassVar[None] = None
    """No dual clip: the tokens' ratios are already clipped."""


class GPGConfig(Section):
    type: Literal["gpg"] = "gpg"
    """The plain policy gradient -A log pi, no ratio and no clip (Group Policy Gradient, arXiv 2504.02546; verl's
    `gpg`). Its gradient is the on-policy one: with several optimizer steps per batch (`learner.ppo_epochs`,
    `learner.mini_batch_size`) the later steps are not corrected for the policy having moved."""
    aggregation: Aggregation = _aggregation("token_mean")
    norm_len: int | None = _norm_len()


class ClipCovConfig(Section):
    type: Literal["clip_cov"] = "clip_cov"
    """PPO's clipped loss with the gradient cut on a random few of the tokens whose covariance between log-prob and
    advantage is high, to keep entropy from collapsing (Clip-Cov, Cui et al. 2025, arXiv 2505.22617; verl's
    `clip_cov`). The tokens are chosen over the whole batch (`distrl.algo.covariance`)."""
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """PPO's: the ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0.0)
    """PPO's: the ratio is clipped above at 1 + clip_high."""
    dual_clip: float | None = Field(default=None, gt=1.0)
    """PPO's dual-clip constant c > 1; null disables."""
    clip_cov_ratio: float = Field(default=2e-4, ge=0.0, le=1.0)
    """r: the share of the batch's valid tokens whose gradient is cut (at least one when > 0; the paper's 2e-4).
    0 makes the loss PPO's."""
    clip_cov_lb: float = 1.0
    """omega_low: a token is a candidate when its covariance exceeds this (the paper's 1)."""
    clip_cov_ub: float = 5.0
    """omega_high: ... and is below this (the paper's 5)."""
    aggregation: Aggregation = _aggregation("token_mean")
    norm_len: int | None = _norm_len()

    @model_validator(mode="after")
    def _band(self) -> ClipCovConfig:
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ValueError(f"loss.policy.clip_cov_lb ({self.clip_cov_lb}) must be below loss.policy.clip_cov_ub "
                             f"({self.clip_cov_ub}): the candidates' covariance lies between them")
        return self


class KLCovConfig(Section):
    type: Literal["kl_cov"] = "kl_cov"
    """The unclipped loss -A r, plus a KL penalty coef |log r| on the tokens whose covariance between log-prob and
    advantage is the largest, to keep entropy from collapsing (KL-Cov, Cui et al. 2025, arXiv 2505.22617; verl's
    `kl_cov`). The tokens are chosen over the whole batch (`distrl.algo.covariance`). The penalty acts once the
    policy has moved from pi_old: with one optimizer step per batch its gradient is 0."""
    kl_cov_ratio: float = Field(default=2e-3, ge=0.0, le=1.0)
    """k: the share of the batch's valid tokens penalised, those of largest covariance (at least one when > 0;
    the paper's 2e-3 for Qwen2.5-7B, 2e-4 for 32B)."""
    ppo_kl_coef: float = Field(default=1.0, ge=0.0)
    """beta: weight of the penalty |log pi - log pi_old| on the selected tokens (the paper's 1)."""
    aggregation: Aggregation = _aggregation("token_mean")
    norm_len: int | None = _norm_len()


POLICY = Variants("type", "ppo", {"ppo": PPOConfig, "gspo": GSPOConfig, "cispo": CISPOConfig, "sapo": SAPOConfig,
                                  "gmpo": GMPOConfig, "gpg": GPGConfig, "clip_cov": ClipCovConfig,
                                  "kl_cov": KLCovConfig})
PolicyConfig = Annotated[PPOConfig | GSPOConfig | CISPOConfig | SAPOConfig | GMPOConfig | GPGConfig | ClipCovConfig
                         | KLCovConfig, Field(discriminator="type"), POLICY.shorthand]
"""`loss.policy: gspo` is shorthand for `{type: gspo}` (the paper's clip range), and likewise for every type."""
