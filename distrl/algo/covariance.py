"""Clip-Cov and KL-Cov: the tokens whose log-prob and advantage covary the most have their gradient cut, or a KL
penalty, so that entropy does not collapse (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv 2505.22617; verl's `compute_policy_loss_clip_cov` / `_kl_cov`).

    cov_t = (log pi_old_t - mean log pi_old) (A_t - mean A)         means over the batch's N valid tokens
    Clip-Cov  I = a uniformly random max(1, floor(r N)) of the tokens with omega_low < cov_t < omega_high
              pg_t = PPO's clipped loss, and 0 (value and gradient) on I
    KL-Cov    I = the max(1, floor(k N)) tokens of largest cov_t
              pg_t = -A_t r_t + beta |log r_t| on I, -A_t r_t elsewhere (no clip)

The selection is the whole batch's, made once before the batch is split (`covariance_selection`): the driver makes it
on each mini-batch's rows (`distrl.batching.select_by_covariance`) and the learners receive it with their rows as
`TrainBatch.cov_selected`, so that micro-batches and data-parallel learners cut or penalise exactly the tokens the
whole batch would. `compute_loss` takes it as `LossInputs.cov_selected` and refuses to run these losses without it.

Deliberate departures from the paper's code (verl), which selects per micro-batch from the current log-probs:
- The selection is over the batch an optimizer step trains on (a mini-batch, all learners' shards of it), not a
  micro-batch: the paper's N is the batch's tokens, and a per-micro-batch top fraction would change with the
  micro-batch size and the number of learners.
- The covariance uses the old log-probs (pi_old, the policy the update starts from), not the current ones: they are
  known before the update, so the selection needs no extra forward pass, and at the update's first optimizer step
  they are the current ones exactly; at later steps (several mini-batches or epochs) the selection stays that of
  pi_old. Hence `Config.old_logprobs_in_update` is false for these losses: the old log-probs are scored before.
- Clip-Cov's candidates are not narrowed to the tokens PPO's clip leaves alone (verl drops those, which needs the
  current ratio): a selected token that PPO clips already had no gradient, so the cut changes nothing there.
Inputs are expected to be zero on padding already (`compute_loss` does that).
"""

from __future__ import annotations

import math

import torch

from distrl.algo.masked import masked_sum, valid_of, zero_padding
from distrl.algo.policy import exp_ratio
from distrl.config import ClipCovConfig, KLCovConfig


def token_covariance(old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """cov_t `[B, T]` (0 on padding): the centred product of each valid token's old log-prob and advantage, centred
    by their means over the valid tokens of the whole `[B, T]` batch (the paper's Cov over the batch)."""
    valid = valid_of(mask)
    n = valid.sum().clamp(min=1).to(old_logprobs.dtype)
    centred_logprobs = old_logprobs - masked_sum(old_logprobs, valid) / n
    centred_advantages = advantages - masked_sum(advantages, valid) / n
    return zero_padding(centred_logprobs * centred_advantages, valid)


def selection_size(fraction: float, valid_tokens: int) -> int:
    """How many tokens a fraction of `valid_tokens` selects: floor(fraction N), at least one when the fraction and N
    are positive (as verl's max(int(ratio N), 1)), 0 otherwise."""
    if fraction <= 0 or valid_tokens == 0:
        return 0
    return max(1, math.floor(fraction * valid_tokens))


def kl_cov_selection(cov: torch.Tensor, mask: torch.Tensor, fraction: float) -> torch.Tensor:
    """KL-Cov's I `[B, T]` bool: the `selection_size(fraction, N)` valid tokens of largest covariance."""
    valid = valid_of(mask)
    k = selection_size(fraction, int(valid.sum()))
    scores = torch.where(valid, cov, -torch.inf).flatten()
    selected = torch.zeros(scores.numel(), dtype=torch.bool, device=cov.device)
    selected[torch.topk(scores, k).indices] = True
    return selected.view(cov.shape)


def clip_cov_selection(cov: torch.Tensor, mask: torch.Tensor, fraction: float, low: float, high: float,
                       generator: torch.Generator) -> torch.Tensor:
    """Clip-Cov's I `[B, T]` bool: `selection_size(fraction, N)` tokens drawn uniformly without replacement (from
    `generator`) among the valid tokens with low < cov < high; all of them when fewer."""
    valid = valid_of(mask)
    k = selection_size(fraction, int(valid.sum()))
    candidates = torch.nonzero((valid & (cov > low) & (cov < high)).flatten()).squeeze(-1)
    order = torch.randperm(candidates.numel(), generator=generator, device=generator.device)
    selected = torch.zeros(cov.numel(), dtype=torch.bool, device=cov.device)
    selected[candidates[order[:k].to(candidates.device)]] = True
    return selected.view(cov.shape)


def covariance_selection(old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                         policy: ClipCovConfig | KLCovConfig, generator: torch.Generator) -> torch.Tensor:
    """The tokens `[B, T]` bool that `policy` (clip_cov or kl_cov) cuts or penalises in the batch `old_logprobs`,
    `advantages`, `mask` (`[B, T]` each: the whole batch of one optimizer step, before any split)."""
    cov = token_covariance(old_logprobs.detach(), advantages.detach(), mask)
    if isinstance(policy, ClipCovConfig):
        return clip_cov_selection(cov, mask, policy.clip_cov_ratio, policy.clip_cov_lb, policy.clip_cov_ub,
                                  generator)
    return kl_cov_selection(cov, mask, policy.kl_cov_ratio)


def kl_cov_term(log_ratio: torch.Tensor, advantages: torch.Tensor, selected: torch.Tensor, coef: float,
                ) -> torch.Tensor:
    """KL-Cov's per-token loss `[B, T]`: -A r + coef |log r| on the `selected` tokens (0/1), -A r elsewhere, with
    r = exp(clamp(log_ratio, -20, 20)). `log_ratio` carries the gradient; |log r| is not clamped (it cannot
    overflow), and its gradient at r = 1 is 0."""
    return -advantages * exp_ratio(log_ratio) + coef * (log_ratio.abs() * selected)
