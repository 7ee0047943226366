"""`policy_term`: the per-token policy loss `pg` of every `loss.policy.type`, and the figures its users watch, as the
plain composition of each loss's own functions under autograd: the definitions that `reference_loss` composes and
that the fused path (`fused_policy.py`) reproduces.

    type      pg                                               module           figures
    ppo       max(-A r, -A clip(r)), dual clip                 policy.py        clip_frac, dual_clip_frac
    gspo      the same of the sequence ratio s_i              policy.py        clip_frac, seq_ratio_*
    cispo     -sg(clip(r)) A log pi                            reinforce.py     clip_frac
    sapo      -sigmoid(tau (r - 1)) 4 / tau A                  sapo.py          gate_mean, gated_frac
    gmpo      -A rho_i, rho_i the clipped geometric mean       gmpo.py          clip_frac, seq_ratio_*
    gpg       -A log pi                                        reinforce.py     (none of its own)
    clip_cov  PPO's, 0 on the covariance-selected tokens       covariance.py    clip_frac, dual_clip_frac, cov_frac
    kl_cov    -A r, + coef |log r| on the selected tokens      covariance.py    cov_frac

Every figure is a token mean over the valid tokens but seq_ratio_min / max. Names are shared where the meaning is:
clip_frac is the share of tokens whose ratio (or weight, for cispo) a clip changed; cov_frac the share selected by
covariance. `ppo_kl`, the mean of log pi_old - log pi, is every type's (`reference_loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from distrl.algo.covariance import kl_cov_term
from distrl.algo.gmpo import gmpo_term
from distrl.algo.loss_inputs import LossInputs
from distrl.algo.masked import masked_mean
from distrl.algo.policy import (
    clipped_surrogate,
    exp_ratio,
    gspo_log_ratio,
    ppo_log_ratio,
    sequence_ratio_metrics,
)
from distrl.algo.reinforce import cispo_term, gpg_term
from distrl.algo.sapo import GATED_BELOW, sapo_term
from distrl.config import PolicyConfig

Term = tuple[torch.Tensor, dict[str, torch.Tensor]]


def policy_term(x: LossInputs, cfg: PolicyConfig) -> Term:
    """`pg` `[B, T]` of `cfg.type` and its figures (0-dim, detached), from `x` already zero on padding with its
    constants detached (`reference_loss` makes it so); only `x.logprobs` carries gradient."""
    if cfg.type not in TERMS:
        raise ValueError(f"unknown policy loss {cfg.type!r}; expected one of {', '.join(TERMS)}")
    pg, metrics = TERMS[cfg.type](x, cfg)
    return pg, {key: value.detach() for key, value in metrics.items()}


def _dtype(x: LossInputs) -> torch.dtype:
    """The dtype the loss is computed in (bfloat16 log-probs against float32 old ones: float32)."""
    return torch.result_type(x.logprobs, x.old_logprobs)


def _share(indicator: torch.Tensor, x: LossInputs) -> torch.Tensor:
    return masked_mean(indicator.to(_dtype(x)), x.mask)


def _ppo(x: LossInputs, cfg: Any) -> Term:
    pg, clipped, dual = clipped_surrogate(ppo_log_ratio(x.logprobs, x.old_logprobs), x.advantages, cfg.clip_low,
                                          cfg.clip_high, cfg.dual_clip)
    return pg, {"clip_frac": _share(clipped, x), "dual_clip_frac": _share(dual, x)}


def _gspo(x: LossInputs, cfg: Any) -> Term:
    pg, clipped, _ = clipped_surrogate(gspo_log_ratio(x.logprobs, x.old_logprobs, x.mask), x.advantages,
                                       cfg.clip_low, cfg.clip_high, None)
    s = exp_ratio(masked_mean(x.logprobs.detach() - x.old_logprobs, x.mask, dim=-1))  # GSPO's s_i, [B]
    return pg, {"clip_frac": _share(clipped, x), **sequence_ratio_metrics(s, x.mask.sum(-1))}


def _cispo(x: LossInputs, cfg: Any) -> Term:
    pg, clipped = cispo_term(x.logprobs, x.old_logprobs, x.advantages, cfg.clip_low, cfg.clip_high)
    return pg, {"clip_frac": _share(clipped, x)}


def _sapo(x: LossInputs, cfg: Any) -> Term:
    pg, gate = sapo_term(x.logprobs - x.old_logprobs, x.advantages, cfg.tau_pos, cfg.tau_neg)
    return pg, {"gate_mean": masked_mean(gate, x.mask), "gated_frac": _share(gate < GATED_BELOW, x)}


def _gmpo(x: LossInputs, cfg: Any) -> Term:
    pg, rho, clipped = gmpo_term(x.logprobs, x.old_logprobs, x.advantages, x.mask, cfg.clip_low, cfg.clip_high)
    return pg, {"clip_frac": _share(clipped, x), **sequence_ratio_metrics(rho, x.mask.sum(-1))}


def _gpg(x: LossInputs, cfg: Any) -> Term:
    return gpg_term(x.logprobs, x.advantages), {}


def _clip_cov(x: LossInputs, cfg: Any) -> Term:
    assert x.cov_selected is not None  # require_inputs
    pg, figures = _ppo(x, cfg)
    selected = x.cov_selected.to(pg.dtype)
    return pg * (1.0 - selected), {**figures, "cov_frac": _share(selected, x)}


def _kl_cov(x: LossInputs, cfg: Any) -> Term:
    assert x.cov_selected is not None  # require_inputs
    selected = x.cov_selected.to(_dtype(x))
    pg = kl_cov_term(x.logprobs - x.old_logprobs, x.advantages, selected, cfg.ppo_kl_coef)
    return pg, {"cov_frac": _share(selected, x)}


TERMS: dict[str, Callable[[LossInputs, Any], Term]] = {
    "ppo": _ppo, "gspo": _gspo, "cispo": _cispo, "sapo": _sapo, "gmpo": _gmpo, "gpg": _gpg, "clip_cov": _clip_cov,
    "kl_cov": _kl_cov}
"""Each `loss.policy.type`'s term, by type."""
