"""Policy losses on A log pi, without PPO's clipped surrogate: GPG's plain policy gradient, and CISPO's clipped
importance weight as a stop-gradient coefficient.

    gpg    pg = -A log pi                          (Group Policy Gradient, Chu et al. 2025, arXiv 2504.02546)
    cispo  pg = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi,   r = pi / pi_old
                                                   (CISPO, MiniMax-M1, arXiv 2506.13585)

Both have the gradient -w A grad log pi on every token (w = 1, or the clipped weight): no token's gradient is
dropped, where PPO's is 0 on a clipped token. Their value is the surrogate's, log pi times a constant, as in the papers
and in verl (`compute_policy_loss_gpg`, `compute_policy_loss_cispo`): not an objective's value, so `loss/policy` of
these two does not compare with PPO's; the reward, `ppo_kl` and `clip_frac` tell how training goes.
Inputs are expected to be zero on padding already (`compute_loss` does that).
"""

from __future__ import annotations

import torch

from distrl.algo.policy import exp_ratio


def reinforce_term(logprobs: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """pg = -coef log pi `[B, T]`, with `coef` `[B, T]` a constant (detached): its gradient is -coef."""
    return -coef * logprobs


def gpg_term(logprobs: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    """GPG's per-token loss -A log pi `[B, T]` (arXiv 2504.02546): the policy gradient of group-relative
    advantages, no ratio. `advantages` is a constant."""
    return reinforce_term(logprobs, advantages.detach())


def cispo_weight(log_ratio: torch.Tensor, clip_low: float | None, clip_high: float,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's weight sg(clip(r, 1 - clip_low, 1 + clip_high)) `[B, T]` (no lower bound when `clip_low` is None,
    the paper's choice), r = exp(clamp(log_ratio, -20, 20)), and where the clip changed it (`[B, T]` bool)."""
    ratio = exp_ratio(log_ratio.detach())
    weight = torch.clamp(ratio, None if clip_low is None else 1.0 - clip_low, 1.0 + clip_high)
    return weight, torch.ne(weight, ratio)


def cispo_term(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
               clip_low: float | None, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's per-token loss -sg(clip(r)) A log pi `[B, T]` and where the weight was clipped (`[B, T]` bool).
    All `[B, T]`; only `logprobs` carries gradient, whose gradient is -clip(r) A on every token."""
    weight, clipped = cispo_weight(logprobs - old_logprobs, clip_low, clip_high)
    return reinforce_term(logprobs, weight * advantages.detach()), clipped
