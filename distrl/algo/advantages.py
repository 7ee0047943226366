"""Advantage estimators: group-relative ones on sequence rewards `[B]`, token returns `[B, T]`, and GAE.

Group estimators expect the G samples of a prompt in contiguous rows (B = n_groups x G), as `Rollouts` lays them out.
A group whose rewards are all equal carries no learning signal and gets exactly 0 (not a rounding residue).
Everything here is a constant for the loss: outputs are computed without gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

from distrl.algo.masked import valid_of

GroupEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


@torch.no_grad()
def group_advantages(rewards: torch.Tensor, group_size: int, estimator: GroupEstimator | Literal["gae"],
                     eps: float = 1e-6, whiten: bool = False) -> torch.Tensor:
    """Sequence advantages `[B]` from rewards `[B]`, groups of `group_size` contiguous rows.

    grpo                   (r - mean_g) / (std_g + eps), unbiased std       Shao et al. 2024, arXiv 2402.03300
    dr_grpo                r - mean_g                                       Liu et al. 2025, arXiv 2503.20783
    rloo                   r_i - mean of the other G-1 samples              Ahmadian et al. 2024, arXiv 2402.14740
                           = G / (G-1) (r_i - mean_g)
    reinforce_pp           (r - mean_B) / (std_B + eps), over the batch     Hu 2025, REINFORCE++, arXiv 2501.03262
    reinforce_pp_baseline  x = r - mean_g, then x / (std_B(x) + eps)        REINFORCE++-baseline, same paper
    For reinforce_pp_baseline the batch mean of x is 0 by construction, so whitening is only the division: removing a
    float-rounding mean again would make all-equal groups non-zero.

    `whiten=True` then whitens grpo / dr_grpo / rloo advantages over the batch: a / (std_B(a) + eps). Their batch
    mean is 0 by construction, so (as for reinforce_pp_baseline) it is not removed again, which keeps flat groups
    at exactly 0; a batch of all-flat groups stays 0. dr_grpo with whitening is reinforce_pp_baseline, and rloo
    with whitening equals it too (rloo is dr_grpo scaled by G / (G-1)). The reinforce_pp estimators already
    whiten, so asking again is an error.
    """
    if estimator not in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        raise ValueError(f"unknown group advantage estimator {estimator!r}"
                         + ("; 'gae' needs values: use distrl.algo.gae" if estimator == "gae" else ""))
    r = rewards.detach().to(torch.promote_types(rewards.dtype, torch.float32))
    if whiten and estimator.startswith("reinforce_pp"):
        raise ValueError(f"{estimator} already whitens over the batch; whiten=True would do it twice")
    if estimator == "reinforce_pp":
        return torch.where(r.amax() == r.amin(), 0.0, _whiten(r - r.mean(), eps))
    if group_size < 2 or r.numel() % group_size:
        raise ValueError(f"{estimator} needs groups of >= 2 contiguous samples dividing the batch: got "
                         f"{r.numel()} rewards, group_size {group_size}")
    groups = r.view(-1, group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    if estimator == "grpo":
        centred = centred / (groups.std(-1, keepdim=True) + eps)
    elif estimator == "rloo":
        centred = centred * (group_size / (group_size - 1))
    # All-equal groups: exactly 0 (the mean of equal floats need not round back to the same float).
    flat = groups.amax(-1, keepdim=True) == groups.amin(-1, keepdim=True)
    adv = torch.where(flat, 0.0, centred).view(-1)
    if estimator == "reinforce_pp_baseline":
        return _whiten(adv, eps)
    if whiten:
        return torch.where(adv.amax() == adv.amin(), 0.0, _whiten(adv, eps))
    return adv


def _whiten(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / (std(x) + eps) over the batch `[B]` (unbiased std; 0 for a single element)."""
    std = x.std() if x.numel() > 1 else x.new_zeros(())
    return x / (std + eps)


@torch.no_grad()
def token_advantages(seq_advantages: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None = None,
                     gamma: float = 1.0) -> torch.Tensor:
    """Per-token advantages `[B, T]`: the discounted return-to-go of token rewards plus the sequence advantage.

    rewards_it = token_rewards_it + seq_advantages_i * [t is the last valid token of i]
    A_it = sum_{s >= t, valid} gamma^(k_s - k_t) rewards_is, k counting valid tokens (holes in the mask are skipped)
    With token_rewards None and gamma = 1 this is seq_advantages broadcast over the response. A KL-in-reward penalty
    enters as token_rewards = -coef * kl (Ouyang et al. 2022, arXiv 2203.02155; REINFORCE++). 0 on padding.
    """
    valid = valid_of(mask)
    dtype = torch.promote_types(seq_advantages.dtype, torch.float32)
    rewards = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
    if token_rewards is not None:
        rewards = torch.where(valid, token_rewards.to(dtype), 0.0)
    t = valid.shape[-1]
    positions = torch.arange(t, device=valid.device)
    last = torch.where(valid, positions, 0).amax(-1)  # last valid index; 0 for an empty row (bonus 0 there)
    bonus = torch.where(valid.any(-1), seq_advantages.to(dtype), 0.0)
    rewards = rewards.scatter_add(-1, last.unsqueeze(-1), bonus.unsqueeze(-1))
    if gamma == 1.0:
        return torch.where(valid, rewards.flip(-1).cumsum(-1).flip(-1), 0.0)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for i in reversed(range(t)):
        running = torch.where(valid[:, i], rewards[:, i] + gamma * running, running)
        out[:, i] = torch.where(valid[:, i], running, 0.0)
    return out


@torch.no_grad()
def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv 1506.02438): `(advantages, returns)` `[B, T]`.

    delta_t = r_t + gamma V_{t+1} - V_t,  A_t = delta_t + gamma lam A_{t+1},  returns R_t = A_t + V_t,
    with V and A beyond the last valid token = 0; masked positions are skipped (the recursion jumps over them)
    and are 0 in both outputs. `rewards`, `values`, `mask` are `[B, T]`.
    """
    valid = valid_of(mask)
    dtype = torch.promote_types(values.dtype, torch.float32)
    r = torch.where(valid, rewards.to(dtype), 0.0)
    v = torch.where(valid, values.to(dtype), 0.0)
    adv = torch.zeros_like(v)
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    for i in reversed(range(v.shape[-1])):
        a = r[:, i] + gamma * next_value - v[:, i] + gamma * lam * next_adv
        next_adv = torch.where(valid[:, i], a, next_adv)
        next_value = torch.where(valid[:, i], v[:, i], next_value)
        adv[:, i] = torch.where(valid[:, i], a, 0.0)
    return adv, torch.where(valid, adv + v, 0.0)


@torch.no_grad()
def whiten_tokens(advantages: torch.Tensor, mask: torch.Tensor, eps: float) -> torch.Tensor:
    """(A - mean) / (std + eps) over the valid tokens of `advantages` `[B, T]` (unbiased std), 0 on padding.

    GAE's token advantages are whitened over the batch as verl (`masked_whiten`) and OpenRLHF do; unlike the group
    estimators' they have no mean 0 by construction, so the mean is removed. A single valid token gives 0.
    """
    valid = valid_of(mask)
    x = advantages.to(torch.promote_types(advantages.dtype, torch.float32))
    n = valid.sum()
    mean = torch.where(valid, x, 0.0).sum() / n.clamp(min=1)
    centred = torch.where(valid, x - mean, 0.0)
    std = (centred.pow(2).sum() / (n - 1).clamp(min=1)).sqrt()
    return torch.where(valid, centred / (std + eps), 0.0)
