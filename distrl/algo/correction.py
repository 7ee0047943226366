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
from distrl.merging import Merge

MERGE = {"is_weight_mean": Merge.TOKEN_MEAN, "is_weight_min": Merge.MIN, "is_weight_max": Merge.MAX,
         # the token-weighted mean of the parts' ESS: close to, not equal to, the ESS of the whole batch
         "is_ess": Merge.TOKEN_MEAN, "is_frac_truncated": Merge.TOKEN_MEAN, "is_frac_masked": Merge.TOKEN_MEAN,
         "mismatch_kl": Merge.TOKEN_MEAN, "mismatch_k3": Merge.TOKEN_MEAN}
"""How each metric of this module merges over micro-batches and learners (`distrl.merging`)."""


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


STALENESS_BUCKETS = (("0", 0, 0), ("1", 1, 1), ("2", 2, 2), ("3", 3, 3), ("4+", 4, None))
"""(name, lowest, highest or None) of the staleness buckets that correction metrics and token ages are split by:
one per age up to 4 (`loop.max_staleness` is rarely set higher; older tokens share `4+`)."""


def metrics_by_staleness(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                         staleness: torch.Tensor, cfg: CorrectionConfig | None) -> dict[str, dict[str, torch.Tensor]]:
    """The mismatch and IS-weight metrics of `rollout_correction` (only the mismatch ones without a correction)
    over the tokens of each staleness bucket (`staleness` `[B, T]`: update version minus the version that sampled
    each token; `[B]` for one version per sample), keyed by bucket name; buckets without a valid token are left
    out. Old log-probs, rollout log-probs, mask:
    `[B, T]`. In the asynchronous mode the behaviour policy of a stale sample is older weights, so the weights
    then correct staleness as well as precision; splitting them shows how much of each."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, low, high in STALENESS_BUCKETS:
        within = (staleness >= low) & (staleness <= high if high is not None else True)
        bucket_mask = valid_of(mask) & (within if within.dim() == 2 else within[:, None])
        if not bucket_mask.any():
            continue
        if cfg is None:
            out[name] = mismatch_metrics(old_logprobs, rollout_logprobs, bucket_mask)
        else:
            out[name] = rollout_correction(old_logprobs, rollout_logprobs, bucket_mask, cfg)[1]
    return out



def correction_with_metrics(d: torch.Tensor, valid: torch.Tensor, lengths: torch.Tensor,
                            cfg: CorrectionConfig | None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """`rollout_correction`'s weights and metrics (`mismatch_metrics` alone when `cfg` is None), bit for bit, from
    d = old_logprobs - rollout_logprobs `[B, T]` already 0 on padding, the 0/1 float mask `valid` `[B, T]` and its row
    sums `lengths` `[B]`, in few passes and without booleans or torch.where over `[B, T]` (both slow on CPU).
    Counts are of non-zero floats, exact in any order."""
    count = lengths.sum()
    by_sequence = cfg is not None and (cfg.mode == "seq_mask_tis" or cfg.level == "sequence")
    row_sums = d.sum(-1) if by_sequence else None  # [B], before d is clamped in place
    mismatch_kl = -d.sum() / count.clamp(min=1)
    d_clamped = d.clamp_(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    spare = torch.expm1(d_clamped).sub_(d_clamped)  # k3 of the mismatch; its memory is reused below
    mismatch = {"mismatch_kl": mismatch_kl, "mismatch_k3": spare.sum() / count.clamp(min=1)}
    if cfg is None:
        return None, mismatch
    token = d_clamped.exp_()
    if cfg.mode == "seq_mask_tis":
        assert row_sums is not None
        geometric = exp_ratio(row_sums / lengths.clamp(min=1)).unsqueeze(-1)  # [B, 1]
        keep_seq = ((geometric >= cfg.low) & (geometric <= cfg.high)).to(d.dtype)
        weights = token.mul_(valid).mul_(keep_seq)
        changed = (lengths * (1.0 - keep_seq.squeeze(-1))).sum()
    elif cfg.level == "sequence":
        assert row_sums is not None
        product = exp_ratio(row_sums).unsqueeze(-1)  # [B, 1]
        out_of_bounds = (product < cfg.low) | (product > cfg.high)
        row = product.clamp(cfg.low, cfg.high) if cfg.mode == "tis" else torch.where(out_of_bounds, 0.0, product)
        weights = row * valid
        changed = (lengths * out_of_bounds.squeeze(-1).to(d.dtype)).sum()
    elif cfg.mode == "tis":
        weights = token.clamp(cfg.low, cfg.high).mul_(valid)
        # on padding the weight 0 and the token ratio 1 always differ: count every difference, then take those off
        changed = (torch.count_nonzero(token.sub_(weights)) - (valid.numel() - count)).to(d.dtype)
    else:
        out_of_bounds = torch.clamp(token, cfg.low, cfg.high, out=spare).sub_(token).abs_().sign_()
        weights = token.addcmul_(token, out_of_bounds, value=-1.0).mul_(valid)  # r - r * 1 = 0, r - r * 0 = r
        changed = torch.dot(out_of_bounds.flatten(), valid.flatten())
    frac_key = "is_frac_truncated" if cfg.mode == "tis" else "is_frac_masked"
    metrics = {**_weight_metrics_of_zeroed(weights, valid, count, spare), frac_key: changed / count.clamp(min=1),
               **mismatch}
    return weights, metrics


def _weight_metrics_of_zeroed(weights: torch.Tensor, valid: torch.Tensor, count: torch.Tensor,
                              spare: torch.Tensor) -> dict[str, torch.Tensor]:
    """`weight_metrics` of non-negative `weights` `[B, T]` that are already 0 on padding (`valid` 0/1 float);
    `spare` is a `[B, T]` buffer it may overwrite."""
    total, sq = weights.sum(), torch.mul(weights, weights, out=spare).sum()
    ess = torch.where(sq > 0, total**2 / (count * sq).clamp(min=torch.finfo(weights.dtype).tiny), 0.0)
    any_valid = count > 0
    # Padding raised to the largest float is never the minimum: lerp(max, w, valid) is w - (w - max) * 0 = w exactly
    # where valid is 1 and max + 0 * (w - max) = max where it is 0 (torch.lerp's two branches). Weights are >= 0, so
    # padding's 0 is never the maximum.
    largest = torch.full((), torch.finfo(weights.dtype).max, dtype=weights.dtype, device=weights.device)
    w_min = torch.lerp(largest, weights, valid, out=spare).amin()
    return {"is_weight_mean": total / count.clamp(min=1), "is_weight_min": torch.where(any_valid, w_min, 0.0),
            "is_weight_max": torch.where(any_valid, weights.amax(), 0.0), "is_ess": ess}
