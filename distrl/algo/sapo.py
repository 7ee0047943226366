"""SAPO's soft gate: a sigmoid of the ratio in place of PPO's hard clip (Soft Adaptive Policy Optimization, Gao et
al. 2025, arXiv 2511.20347; verl's `compute_policy_loss_sapo`).

    r = pi / pi_old,   tau = tau_pos where A > 0, else tau_neg
    f(r) = sigmoid(tau (r - 1)) 4 / tau,   pg = -f(r) A
    d pg / d log pi = -A r 4 s (1 - s),   s = sigmoid(tau (r - 1))

The factor g = 4 s (1 - s) = sech^2(tau (r - 1) / 2) is what the gate lets through of the unclipped importance-
sampled gradient -A r grad log pi: 1 at r = 1, falling smoothly as r leaves 1, the faster the larger tau. As tau -> 0
the gradient tends to the unclipped one; as tau grows, g tends to 0 at every r != 1, a hard trust region that narrows
around r = 1 (tests/algo/test_sapo.py holds both limits). The value f(r) is 2 / tau at r = 1, not r: `loss/policy`
of SAPO does not compare with PPO's.
Inputs are expected to be zero on padding already (`compute_loss` does that).
"""

from __future__ import annotations

import torch

from distrl.algo.policy import exp_ratio

GATED_BELOW = 0.5
"""A token counts as gated (`gated_frac`) when its gate lets through less than half of the gradient."""


def sapo_temperature(advantages: torch.Tensor, tau_pos: float, tau_neg: float) -> torch.Tensor:
    """tau `[B, T]` in A's dtype: tau_pos where A > 0, tau_neg where A <= 0 (the paper's asymmetric temperatures)."""
    return torch.full_like(advantages, tau_neg).masked_fill_(advantages > 0, tau_pos)


def sapo_term(log_ratio: torch.Tensor, advantages: torch.Tensor, tau_pos: float, tau_neg: float,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """SAPO's per-token loss pg = -f(r) A `[B, T]` and the gate factor g = 4 s (1 - s) `[B, T]` (detached) of each
    token. `log_ratio` = log pi - log pi_old `[B, T]` carries the gradient; its exp is clamped at +-20 as PPO's."""
    tau = sapo_temperature(advantages, tau_pos, tau_neg)
    s = torch.sigmoid(tau * (exp_ratio(log_ratio) - 1.0))
    pg = -(s * (4.0 / tau)) * advantages
    sd = s.detach()
    return pg, 4.0 * sd * (1.0 - sd)
