"""The per-token policy-gradient term of PPO and GSPO, before importance weights and aggregation.

Both share one clipped surrogate and differ only in the ratio: PPO's per-token ratio pi / pi_old, or GSPO's
length-normalised sequence ratio, written token-wise so that the gradient still flows token by token.
Inputs are expected to be zero on padding already (`compute_loss` does that), so no NaN can come from there.
"""

from __future__ import annotations

import torch

from distrl.algo.masked import masked_mean

# exp(20) ~ 5e8: large enough never to bind on a sane update, small enough to keep exp finite in float32.
LOG_RATIO_CLAMP = 20.0


def exp_ratio(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(clamp(log_ratio, -20, 20)): a probability ratio that stays finite (as verl and OpenRLHF clamp it)."""
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def ppo_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """log r_t = log pi(o_t) - log pi_old(o_t), `[B, T]` (PPO, Schulman et al. 2017, arXiv 1707.06347)."""
    return logprobs - old_logprobs


def gspo_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token form of GSPO's ratio, `[B, T]` (Zheng et al. 2025, arXiv 2507.18071).

    log s_i = (1/|o_i|) sum_t (log pi - log pi_old)                     (length-normalised sequence ratio)
    log s_it = sg(log s_i) + log pi_t - sg(log pi_t)
    The value of s_it is s_i on every token; its gradient w.r.t. log pi_t is s_i, so with one advantage per sequence
    and seq_mean_token_mean aggregation the gradient equals that of the sequence-level objective.
    """
    log_seq = masked_mean(logprobs - old_logprobs, mask, dim=-1).unsqueeze(-1)  # [B, 1]
    return log_seq.detach() + logprobs - logprobs.detach()


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped loss per token, `[B, T]`, with the masks of where clipping is active.

    r = exp(clamp(log_ratio, -20, 20))
    pg = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))                      (PPO, arXiv 1707.06347 eq. 7)
    for A < 0 with dual clip c:  pg = min(pg, -c A)                              (Ye et al. 2020, arXiv 1912.09729)
    Asymmetric bounds are DAPO's clip-higher (arXiv 2503.14476).
    Returns (pg, clipped, dual_clipped): `clipped` marks tokens where the clipped branch is the max (its gradient
    is 0), `dual_clipped` tokens where the dual-clip cap binds (gradient 0 too).
    """
    ratio = exp_ratio(log_ratio)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    dual_clipped = torch.zeros_like(clipped)
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (pg > cap)
        # Only negative advantages are capped: for A >= 0, -c A <= 0 would wrongly floor the loss.
        pg = torch.where(dual_clipped, cap, pg)
    return pg, clipped, dual_clipped


def sequence_ratio_metrics(ratio: torch.Tensor, lengths: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the sequences' ratios (GSPO's s_i, GMPO's rho_i; `ratio` `[B]`) strayed from 1, as 0-dim tensors:
    seq_ratio_mean (weighted by each sequence's valid tokens `lengths` `[B]`, so that it merges over micro-batches
    as a token mean), seq_ratio_min, seq_ratio_max (over non-empty sequences; all 0 when there is none)."""
    weights = lengths.to(ratio.dtype)
    present = weights > 0
    any_present = present.any()
    low = torch.where(present, ratio, torch.inf).amin() if ratio.numel() else ratio.new_zeros(())
    high = torch.where(present, ratio, -torch.inf).amax() if ratio.numel() else ratio.new_zeros(())
    return {"seq_ratio_mean": (ratio * weights).sum() / weights.sum().clamp(min=1),
            "seq_ratio_min": torch.where(any_present, low, 0.0), "seq_ratio_max": torch.where(any_present, high, 0.0)}


def clipped_surrogate_with_grad(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    upstream: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """`clipped_surrogate` and its gradient in few passes over `[B, T]`, without booleans or torch.where (both slow
    on CPU). Consumes `log_ratio` (overwritten).

    All `[B, T]`; `upstream` is d loss / d pg (scalar or `[B, 1]`; None: no gradient). Returns (pg,
    d loss / d log_ratio or None, clipped count, dual-clipped count or None), counts as 0-dim floats. pg and the
    counts equal `clipped_surrogate`'s bit for bit (pg = -min(A r, A clip(r)) is max(-A r, -A clip(r)) exactly);
    the gradient is -upstream A r, 0 where the clipped branch, the dual-clip cap or the +-20 clamp of the
    log-ratio binds. At an exact tie of both branches with the ratio outside the clip range (a rounding
    coincidence, or A = 0) autograd splits torch.maximum's gradient in half; here the unclipped branch takes all
    of it, as `clipped` counts the token as not clipped.
    """
    log_ratio_c = torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    overshoot = log_ratio.sub_(log_ratio_c)  # 0, or past the clamp by at least ulp(20): its square stays > 0
    ratio = log_ratio_c.exp_()
    gain = advantages * ratio  # A r = -(unclipped term)
    least = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high).mul_(advantages)
    torch.minimum(gain, least, out=least)  # -pg
    clip_gap = gain - least  # pg - unclipped: >= 0, and > 0 exactly where the clipped branch is the max
    blocked = torch.addcmul(clip_gap, overshoot, overshoot, out=overshoot)  # > 0 where the gradient is 0
    clipped = clip_gap.sign_().sum()
    dual_clipped = None
    if dual_clip is not None:
        # -pg is raised to the dual-clip floor c A where A < 0; for A >= 0 the floor -c A <= 0 <= -pg never binds.
        capped = torch.maximum(least, advantages.abs().mul_(-dual_clip))
        dual_gap = capped.sub(least)
        blocked += dual_gap
        dual_clipped = dual_gap.sign_().sum()
        least = capped
    grad = None
    if upstream is not None:
        kept = torch.eq(blocked, 0, out=blocked)  # 1.0 where the gradient flows, 0.0 where it is blocked
        grad = torch.mul(gain, -upstream).mul_(kept)
    return least.neg_(), grad, clipped, dual_clipped
