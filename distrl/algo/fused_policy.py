"""The fused form of every `loss.policy.type`'s term (`policy_terms.py`): its per-token value `pg`, d loss / d log pi
formed in the forward pass, and its figures, for `fused_loss`.

Each function computes `pg` and the figures with the same operations on the same values, in the same order, as its
definition in `policy_terms.py` (so that they are equal bit for bit), and the gradient as the derivative of its own
per-token function (equal to autograd's to float rounding): `tests/algo/test_fused_loss.py` holds them to that.
Every input is 0 on padding and finite, so `pg` and the gradient are 0 there.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from distrl.algo.gmpo import gmpo_clipped_log_ratio
from distrl.algo.policy import LOG_RATIO_CLAMP, clipped_surrogate_with_grad, exp_ratio, sequence_ratio_metrics
from distrl.algo.reinforce import cispo_weight, reinforce_term
from distrl.algo.sapo import GATED_BELOW, sapo_temperature

Fused = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]


@dataclass
class TokenTerms:
    """The inputs of a fused term, `[B, T]` and 0 on padding but where noted.

    diff        log pi - log pi_old; a temporary the term may overwrite
    logprobs    log pi, detached (None unless `NEEDS_LOGPROBS` names the type)
    advantages  A
    valid       1.0 on valid tokens, 0.0 on padding; lengths `[B]` its row sums; count `()` valid tokens, at least 1
    selected    1.0 on the tokens selected by covariance (clip_cov, kl_cov), else None
    upstream    d loss / d pg on valid tokens: a scalar or `[B, 1]` (the aggregation's); None when no gradient is asked
    """

    diff: torch.Tensor
    logprobs: torch.Tensor | None
    advantages: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor
    count: torch.Tensor
    selected: torch.Tensor | None
    upstream: torch.Tensor | None

    def share(self, indicator: torch.Tensor) -> torch.Tensor:
        """The token mean of a 0/1 `indicator` `[B, T]` (any value on padding) over the valid tokens."""
        return (indicator.to(self.valid.dtype) * self.valid).sum() / self.count

    def inside_clamp(self, log_ratio: torch.Tensor) -> torch.Tensor:
        """1.0 where exp_ratio's clamp of `log_ratio` does not bind (its gradient flows), else 0.0."""
        return torch.le(log_ratio.abs(), LOG_RATIO_CLAMP).to(log_ratio.dtype)


NEEDS_LOGPROBS = ("gspo", "cispo", "gpg")
"""The types whose value reads log pi itself, not only log pi - log pi_old."""


def _ppo(t: TokenTerms, cfg: Any) -> Fused:
    pg, grad, clipped, dual = clipped_surrogate_with_grad(t.diff, t.advantages, t.upstream, cfg.clip_low,
                                                          cfg.clip_high, cfg.dual_clip)
    dual_frac = t.count.new_zeros(()) if dual is None else dual.to(t.count.dtype) / t.count
    return pg, grad, {"clip_frac": clipped.to(t.count.dtype) / t.count, "dual_clip_frac": dual_frac}


def _gspo(t: TokenTerms, cfg: Any) -> Fused:
    assert t.logprobs is not None
    log_seq = (t.diff.sum(-1) / t.lengths.clamp(min=1)).unsqueeze(-1)  # gspo_log_ratio: sg(log s_i) + log pi - sg(.)
    log_ratio = log_seq + t.logprobs - t.logprobs
    pg, grad, clipped, _ = clipped_surrogate_with_grad(log_ratio, t.advantages, t.upstream, cfg.clip_low,
                                                       cfg.clip_high, None)
    return pg, grad, {"clip_frac": clipped.to(t.count.dtype) / t.count,
                      **sequence_ratio_metrics(exp_ratio(log_seq.squeeze(-1)), t.lengths)}


def _cispo(t: TokenTerms, cfg: Any) -> Fused:
    assert t.logprobs is not None
    weight, clipped = cispo_weight(t.diff, cfg.clip_low, cfg.clip_high)
    coef = weight * t.advantages
    grad = None if t.upstream is None else torch.mul(coef, t.upstream).neg_()
    return reinforce_term(t.logprobs, coef), grad, {"clip_frac": t.share(clipped)}


def _gpg(t: TokenTerms, cfg: Any) -> Fused:
    assert t.logprobs is not None
    grad = None if t.upstream is None else torch.mul(t.advantages, t.upstream).neg_()
    return reinforce_term(t.logprobs, t.advantages), grad, {}


def _sapo(t: TokenTerms, cfg: Any) -> Fused:
    tau = sapo_temperature(t.advantages, cfg.tau_pos, cfg.tau_neg)
    ratio = exp_ratio(t.diff)
    s = torch.sigmoid(tau * (ratio - 1.0))
    pg = -(s * (4.0 / tau)) * t.advantages
    gate = 4.0 * s * (1.0 - s)  # d f / d log r = r g: the gate's share of the unclipped gradient -A r
    grad = None
    if t.upstream is not None:
        grad = (ratio * gate).mul_(t.advantages).mul_(t.inside_clamp(t.diff)).mul_(t.upstream).neg_()
    return pg, grad, {"gate_mean": (gate * t.valid).sum() / t.count, "gated_frac": t.share(gate < GATED_BELOW)}


def _gmpo(t: TokenTerms, cfg: Any) -> Fused:
    clipped_log_ratio = gmpo_clipped_log_ratio(t.diff, t.advantages, cfg.clip_low, cfg.clip_high)
    log_rho = clipped_log_ratio.sum(-1) / t.lengths.clamp(min=1)  # [B]
    token = log_rho.unsqueeze(-1) + clipped_log_ratio - clipped_log_ratio
    ratio = exp_ratio(token)
    pg = -t.advantages * ratio
    clipped = torch.ne(clipped_log_ratio, t.diff).logical_and_(torch.ne(t.advantages, 0))
    grad = None
    if t.upstream is not None:  # d x~ / d log pi: 1 where the token's clip does not bind
        kept = 1.0 - clipped.to(ratio.dtype)
        grad = (t.advantages * ratio).mul_(kept).mul_(t.inside_clamp(token)).mul_(t.upstream).neg_()
    return pg, grad, {"clip_frac": t.share(clipped), **sequence_ratio_metrics(exp_ratio(log_rho), t.lengths)}


def _clip_cov(t: TokenTerms, cfg: Any) -> Fused:
    assert t.selected is not None
    pg, grad, figures = _ppo(t, cfg)
    kept = 1.0 - t.selected
    pg = pg * kept
    if grad is not None:
        grad.mul_(kept)
    return pg, grad, {**figures, "cov_frac": t.share(t.selected)}


def _kl_cov(t: TokenTerms, cfg: Any) -> Fused:
    assert t.selected is not None
    ratio = exp_ratio(t.diff)
    pg = -t.advantages * ratio + cfg.ppo_kl_coef * (t.diff.abs() * t.selected)
    grad = None
    if t.upstream is not None:  # -A r (0 where the clamp binds) + coef sign(log r) on the selected tokens
        grad = (t.advantages * ratio).mul_(t.inside_clamp(t.diff)).neg_()
        grad.addcmul_(torch.sign(t.diff), t.selected, value=cfg.ppo_kl_coef).mul_(t.upstream)
    return pg, grad, {"cov_frac": t.share(t.selected)}


FUSED: dict[str, Callable[[TokenTerms, Any], Fused]] = {
    "ppo": _ppo, "gspo": _gspo, "cispo": _cispo, "sapo": _sapo, "gmpo": _gmpo, "gpg": _gpg, "clip_cov": _clip_cov,
    "kl_cov": _kl_cov}
"""Each `loss.policy.type`'s fused term: (pg, d loss / d log pi or None, figures), before correction weights."""
