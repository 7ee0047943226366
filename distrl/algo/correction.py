"""Importance weights that correct the rollout/trainer mismatch, and the metrics that monitor it.

vLLM samples from pi_rollout, which differs from the trainer's pi_old (other kernels, lower precision, top-p).
Decoupled PPO weights each token's policy term by pi_old / pi_rollout, bounded to keep variance in check:
  tis           w = clamp(ratio, low, high)          truncated IS (Yao et al. 2025, "Your efficient RL framework
                                                     secretly brings you off-policy RL training", fengyao.notion.site)
  icepop        w = ratio if low <= ratio <= high else 0   (inclusionAI Ling team 2025, "Small Leak Can Sink a
                                                     Great Ship: Boost RL Training on MoE with IcePop!")
  seq_mask_tis  w = ratio, but 0 on every token of a sequence whose geometric-mean ratio leaves [low, high]
                (OpenRLHF's seq-mask-TIS)
`level="sequence"` (tis/icepop) replaces the token ratio by the sequence's product ratio exp(sum_t d_t).
Weights are constants (detached) and 0 on padding; they multiply the policy term only.
"""

from __future__ import annotations

import torch

from distrl.algo.masked import masked_mean, masked_sum, valid_of, zero_padding
from distrl.algo.policy import LOG_RATIO_CLAMP, exp_ratio
from distrl.config import CorrectionConfig


def mismatch_metrics(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                     mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """KL(pi_rollout || pi_old) estimated on the rollout's own samples, as 0-dim tensors (Schulman 2020 k1, k3).

    d = log pi_old - log pi_rollout;  mismatch_kl = mean(-d) (k1);  mismatch_k3 = mean(exp(d) - 1 - d) (k3)
    """
    d = zero_padding(old_logprobs - rollout_logprobs, mask).detach()
    d_clamped = d.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return {"mismatch_kl": masked_mean(-d, mask), "mismatch_k3": masked_mean(torch.expm1(d_clamped) - d_clamped, mask)}


def _token_and_seq_ratios(d: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From d = log pi_old - log pi_rollout `[B, T]` (0 on padding): token ratio `[B, T]`, sequence product ratio
    `[B, 1]` and sequence geometric-mean ratio `[B, 1]`, each log clamped to +-20 before exp."""
    token = exp_ratio(d)
    product = exp_ratio(masked_sum(d, mask, dim=-1)).unsqueeze(-1)
    geometric = exp_ratio(masked_mean(d, mask, dim=-1)).unsqueeze(-1)
    return token, product, geometric


def rollout_correction(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: CorrectionConfig,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached IS weights `[B, T]` (0 on padding) from `old_logprobs`, `rollout_logprobs`, `mask` `[B, T]`,
    and metrics over valid tokens as 0-dim tensors: is_weight_mean/min/max, is_frac_truncated (tis) or
    is_frac_masked (icepop, seq_mask_tis), is_ess, mismatch_kl, mismatch_k3."""
    valid = valid_of(mask)
    d = zero_padding(old_logprobs - rollout_logprobs, valid).detach()
    token, product, geometric = _token_and_seq_ratios(d, valid)
    if cfg.mode == "seq_mask_tis":
        keep_seq = (geometric >= cfg.low) & (geometric <= cfg.high)  # [B, 1]
        weights = torch.where(keep_seq, token, 0.0)
        changed = ~keep_seq.expand_as(valid)
    else:
        ratio = product.expand_as(token) if cfg.level == "sequence" else token
        out_of_bounds = (ratio < cfg.low) | (ratio > cfg.high)
        # tis truncates out-of-bounds ratios, icepop drops them
        weights = ratio.clamp(cfg.low, cfg.high) if cfg.mode == "tis" else torch.where(out_of_bounds, 0.0, ratio)
        changed = out_of_bounds
    weights = torch.where(valid, weights, 0.0)
    frac_key = "is_frac_truncated" if cfg.mode == "tis" else "is_frac_masked"
    metrics = {**weight_metrics(weights, valid), frac_key: masked_mean(changed.to(d.dtype), valid),
               **mismatch_metrics(old_logprobs, rollout_logprobs, valid)}
    return weights, metrics


def weight_metrics(weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Mean / min / max of `weights` `[B, T]` over valid tokens, and the normalised effective sample size
    ESS = (sum w)^2 / (N sum w^2) in [0, 1] (Kong 1992): 1 when all weights are equal, 1/N when one dominates.
    All 0 when nothing is valid. Computed without boolean indexing, so no device sync happens here."""
    valid = valid_of(mask)
    any_valid = valid.any()
    w = zero_padding(weights, valid)
    n = valid.sum().to(w.dtype)
    total, sq = w.sum(), (w * w).sum()
    ess = torch.where(sq > 0, total**2 / (n * sq).clamp(min=torch.finfo(w.dtype).tiny), 0.0)
    w_min = torch.where(valid, weights, torch.inf).amin()
    w_max = torch.where(valid, weights, -torch.inf).amax()
    return {"is_weight_mean": total / n.clamp(min=1), "is_weight_min": torch.where(any_valid, w_min, 0.0),
            "is_weight_max": torch.where(any_valid, w_max, 0.0), "is_ess": ess}


STALENESS_BUCKETS = (("0", 0, 0), ("1", 1, 1), ("2+", 2, None))
"""(name, lowest, highest or None) of the staleness buckets that correction metrics are split by."""


def metrics_by_staleness(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         staleness: torch.Tensor, cfg: CorrectionConfig | None) -> dict[str, dict[str, torch.Tensor]]:
    """The mismatch and IS-weight metrics of `rollout_correction` (only the mismatch ones without a correction)
    over the samples of each staleness bucket (`staleness` `[B]`: update version minus generating version),
    keyed by bucket name; buckets without a valid token are left out. Old log-probs, rollout log-probs, mask:
    `[B, T]`. In the asynchronous mode the behaviour policy of a stale sample is older weights, so the weights
    then correct staleness as well as precision; splitting them shows how much of each."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, low, high in STALENESS_BUCKETS:
        rows = (staleness >= low) & (staleness <= high if high is not None else True)
        bucket_mask = valid_of(mask) & rows[:, None]
        if not bucket_mask.any():
            continue
        if cfg is None:
            out[name] = mismatch_metrics(old_logprobs, rollout_logprobs, bucket_mask)
        else:
            out[name] = rollout_correction(old_logprobs, rollout_logprobs, bucket_mask, cfg)[1]
    return out
