"""GMPO: the geometric mean of a sequence's token ratios, each clipped in log space, as the sequence's ratio
(Geometric-Mean Policy Optimization, Zhao et al. 2025, arXiv 2507.20673; verl's `compute_policy_loss_geo_mean`).

    x_t = log pi_t - log pi_old_t
    x~_t = sgn(A) min(sgn(A) x_t, sgn(A) clip(x_t, -eps_low, eps_high))   (clipped on the side that would grow the
                                                                           objective, as PPO's; 0 where A = 0)
    log rho_i = (1/|o_i|) sum_t x~_t,   loss_i = -A_i rho_i,   mean over sequences

Written token-wise like GSPO's ratio (policy.gspo_log_ratio): log rho_it = sg(log rho_i) + x~_t - sg(x~_t), whose
value is log rho_i on every token and whose gradient with respect to log pi_t is 1 where the clip does not bind, so
that -A_it exp(log rho_it), aggregated seq_mean_token_mean, has the value and the gradient of the sequence-level
objective when A is one per sequence. With no token clipped, rho_i is GSPO's s_i.

Deliberate departures: the sequence's log-ratio is clamped at +-20 before its exp (verl leaves it unclamped), as
every ratio in distrl; token-level advantages (GAE) enter as A_it, where the paper and verl take one per sequence
(verl averages a sequence's advantages).
Inputs are expected to be zero on padding already (`compute_loss` does that).
"""

from __future__ import annotations

import torch

from distrl.algo.masked import masked_mean
from distrl.algo.policy import exp_ratio


def gmpo_clipped_log_ratio(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float, clip_high: float,
                           ) -> torch.Tensor:
    """x~ `[B, T]`: each token's log-ratio clipped at clip_high where A > 0 and at -clip_low where A < 0; 0 where
    A = 0. Its gradient is 1 where the clip does not bind (and A != 0), 0 where it does."""
    sign = torch.sign(advantages)
    bounded = torch.clamp(log_ratio, -clip_low, clip_high)
    return sign * torch.minimum(sign * log_ratio, sign * bounded)


def gmpo_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                   mask: torch.Tensor, clip_low: float, clip_high: float,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token form of GMPO's log-ratio `[B, T]` (module doc), the log geometric-mean ratio log rho_i `[B, 1]`
    (detached), and where the clip binds (`[B, T]` bool, tokens with A != 0)."""
    log_ratio = logprobs - old_logprobs
    clipped_log_ratio = gmpo_clipped_log_ratio(log_ratio, advantages, clip_low, clip_high)
    log_rho = masked_mean(clipped_log_ratio, mask, dim=-1).unsqueeze(-1).detach()  # [B, 1]
    token = log_rho + clipped_log_ratio - clipped_log_ratio.detach()
    clipped = torch.ne(clipped_log_ratio.detach(), log_ratio.detach()) & torch.ne(advantages, 0)
    return token, log_rho, clipped


def gmpo_term(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GMPO's per-token loss -A_it rho_i `[B, T]`, rho_i `[B]` (detached) and where the clip binds (`[B, T]`
    bool). All inputs `[B, T]`; only `logprobs` carries gradient."""
    token, log_rho, clipped = gmpo_log_ratio(logprobs, old_logprobs.detach(), advantages.detach(), mask, clip_low,
                                             clip_high)
    return -advantages.detach() * exp_ratio(token), exp_ratio(log_rho.squeeze(-1)), clipped
