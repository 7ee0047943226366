"""The critic's math for GAE: the clipped value-function loss of PPO, and the explained variance of its values.
Not used by the group estimators."""

from __future__ import annotations

import torch

from distrl.algo.masked import aggregate, masked_mean, valid_of, zero_padding


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None, num_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = 0.5 * sum_it max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2) m_it / N, scalar.

    `values` `[B, T]` carries gradient; `old_values`, `returns`, `mask` `[B, T]` are constants. The clipped branch
    keeps the critic from moving further than `clip` from its rollout-time estimate (OpenAI baselines ppo2;
    torchtune PPOLoss; verl `compute_value_loss`). `clip` None gives the plain squared error. N is `num_tokens`, the
    valid tokens of the whole mini-batch across micro-batches and critics, so that the partial losses of the parts
    sum to the full-batch loss (as the policy loss does, `aggregate`); None: this call's own valid tokens (a masked
    mean). Metrics: `vf_clipfrac`, the fraction of this call's valid tokens where the clipped branch is the larger
    (0-dim tensor; a token mean).
    """
    valid = valid_of(mask)
    v = zero_padding(values, valid)
    old, ret = zero_padding(old_values, valid).detach(), zero_padding(returns, valid).detach()
    unclipped = (v - ret) ** 2
    if clip is None:
        return 0.5 * aggregate(unclipped, valid, "token_mean", num_tokens), {"vf_clipfrac": unclipped.new_zeros(())}
    clipped = (old + torch.clamp(v - old, -clip, clip) - ret) ** 2
    loss = 0.5 * aggregate(torch.maximum(unclipped, clipped), valid, "token_mean", num_tokens)
    return loss, {"vf_clipfrac": masked_mean((clipped > unclipped).to(v.dtype), valid).detach()}


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the valid tokens of `values`, `returns`, `mask` `[B, T]` (0-dim).

    1: the values predict the returns exactly; 0: no better than their mean; negative: worse. Population variances
    (as verl's `explained_var`, whose masked_var is unbiased, differs only by n / (n - 1) in both terms, which
    cancels). NaN when the returns do not vary (nothing to explain), so a constant batch is not read as a fit.
    """
    valid = valid_of(mask)
    v, r = values.to(torch.float64), returns.to(torch.float64)
    err = r - v

    def var(x: torch.Tensor) -> torch.Tensor:
        return masked_mean((x - masked_mean(x, valid)) ** 2, valid)

    var_r = var(r)
    return torch.where(var_r > 0, 1 - var(err) / var_r, torch.full_like(var_r, float("nan"))).float()
