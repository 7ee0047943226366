"""Clipped value-function loss of PPO, for a critic (GAE). Not used by the group estimators."""

from __future__ import annotations

import torch

from distrl.algo.masked import masked_mean, valid_of, zero_padding


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """loss = 0.5 * masked_mean(max((v - R)^2, (clip(v, v_old - clip, v_old + clip) - R)^2)), scalar.

    `values` `[B, T]` carries gradient; `old_values`, `returns`, `mask` `[B, T]` are constants. The clipped branch
    keeps the critic from moving further than `clip` from its rollout-time estimate (OpenAI baselines ppo2;
    torchtune PPOLoss). `clip` None gives the plain squared error. Metrics: `vf_clipfrac`, the fraction of valid
    tokens where the clipped branch is the larger (0-dim tensor).
    """
    valid = valid_of(mask)
    v = zero_padding(values, valid)
    old, ret = zero_padding(old_values, valid).detach(), zero_padding(returns, valid).detach()
    unclipped = (v - ret) ** 2
    if clip is None:
        return 0.5 * masked_mean(unclipped, valid), {"vf_clipfrac": unclipped.new_zeros(())}
    clipped = (old + torch.clamp(v - old, -clip, clip) - ret) ** 2
    loss = 0.5 * masked_mean(torch.maximum(unclipped, clipped), valid)
    return loss, {"vf_clipfrac": masked_mean((clipped > unclipped).to(v.dtype), valid).detach()}
