"""Pure-tensor RL math: masked aggregation, log-probs, advantages, rollout correction, KL, policy and value losses
(PPO, GSPO, CISPO, SAPO, GMPO, GPG, Clip-Cov and KL-Cov: `policy_terms.py` lists them).

Imports torch and `distrl.config` section classes only: no I/O, no logging, no Ray, no vLLM, never the root config.
`compute_loss` is the one composition point; everything else is a small function it (or the driver) calls.
"""

from distrl.algo.advantages import gae, group_advantages, token_advantages, whiten_tokens
from distrl.algo.correction import metrics_by_staleness, mismatch_metrics, rollout_correction, weight_metrics
from distrl.algo.covariance import covariance_selection, token_covariance
from distrl.algo.kl import kl_estimate
from distrl.algo.linear_logprobs import linear_logprobs
from distrl.algo.logprobs import entropy_from_logits, token_logprobs
from distrl.algo.loss import LossInputs, LossOutput, compute_loss
from distrl.algo.loss_reference import reference_loss
from distrl.algo.masked import aggregate, masked_mean, masked_sum
from distrl.algo.policy import clipped_surrogate, gspo_log_ratio, ppo_log_ratio
from distrl.algo.policy_terms import policy_term
from distrl.algo.value import explained_variance, value_loss

__all__ = [
    "LossInputs",
    "LossOutput",
    "aggregate",
    "clipped_surrogate",
    "compute_loss",
    "covariance_selection",
    "entropy_from_logits",
    "explained_variance",
    "gae",
    "group_advantages",
    "gspo_log_ratio",
    "kl_estimate",
    "linear_logprobs",
    "masked_mean",
    "masked_sum",
    "metrics_by_staleness",
    "mismatch_metrics",
    "policy_term",
    "ppo_log_ratio",
    "reference_loss",
    "rollout_correction",
    "token_advantages",
    "token_covariance",
    "token_logprobs",
    "value_loss",
    "weight_metrics",
    "whiten_tokens",
]
