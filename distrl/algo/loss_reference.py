"""`reference_loss`: the policy loss as the plain composition of the small functions, differentiated by autograd.

This is the definition that `compute_loss` (the fused path in `distrl.algo.fused_loss`) must reproduce: three small
functions composed in one place — correction weights (detached), the policy's per-token term (`policy_term`, one per
`loss.policy.type`), the KL estimate — then one `aggregate` call per term. It reads like the formula and is slow
(about 30 passes over `[B, T]` and an autograd graph of as many nodes); tests compare the two on every mode and
`bench/bench_loss.py` times both.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import torch

from distrl.algo.correction import mismatch_metrics, rollout_correction
from distrl.algo.kl import kl_estimate
from distrl.algo.loss_inputs import TENSORS, LossInputs, kl_in_loss, require_inputs
from distrl.algo.masked import aggregate, masked_mean, valid_of, zero_padding
from distrl.algo.policy_terms import policy_term
from distrl.config import CorrectionConfig, LossConfig


def reference_loss(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss of `compute_loss` and its metrics as 0-dim tensors, with autograd's gradients:

        loss = aggregate(w * pg) + kl.coef * aggregate(kl) - entropy_coef * aggregate(entropy)
    """
    require_inputs(inputs.validate(), cfg)
    x = _without_padding(inputs)
    agg = partial(aggregate, mask=x.mask, mode=cfg.policy.aggregation, num_tokens=x.num_tokens, num_seqs=x.num_seqs,
                  norm_len=x.norm_len or cfg.policy.norm_len)

    w, metrics = _correction_weights(x, cfg.correction)
    pg, policy_metrics = policy_term(x, cfg.policy)
    kl = None if x.ref_logprobs is None else kl_estimate(x.logprobs, x.ref_logprobs, cfg.kl.estimator)

    zero = pg.new_zeros(())
    policy_loss = agg(w * pg)
    kl_loss = agg(kl) if kl is not None and kl_in_loss(cfg) else zero
    entropy_loss = agg(x.entropy) if x.entropy is not None and cfg.entropy_coef > 0 else zero
    loss = policy_loss + cfg.kl.coef * kl_loss - cfg.entropy_coef * entropy_loss

    metrics.update({"loss/policy": policy_loss, "loss/kl": kl_loss, "loss/entropy": entropy_loss, "loss/total": loss,
                    **policy_metrics, "ppo_kl": masked_mean((x.old_logprobs - x.logprobs).detach(), x.mask)})
    if kl is not None:
        metrics["kl_ref"] = masked_mean(kl.detach(), x.mask)
    if x.entropy is not None:
        metrics["entropy"] = masked_mean(x.entropy.detach(), x.mask)
    return loss, {key: value.detach() for key, value in metrics.items()}


def _without_padding(inputs: LossInputs) -> LossInputs:
    """The inputs with a boolean mask, every tensor 0 on padding, and the constants detached."""
    mask = valid_of(inputs.mask)
    present = {name: getattr(inputs, name) for name in TENSORS if getattr(inputs, name) is not None}
    tensors = {name: zero_padding(x, mask) for name, x in present.items()}
    constants = {name: x.detach() for name, x in tensors.items() if name not in ("logprobs", "entropy")}
    changes: dict[str, Any] = {**tensors, **constants}
    return replace(inputs, mask=mask, **changes)


def _correction_weights(x: LossInputs, cfg: CorrectionConfig | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rollout-correction weights `[B, T]` (1 without a correction) and the mismatch / weight metrics."""
    if x.rollout_logprobs is None:
        return torch.ones_like(x.old_logprobs), {}
    if cfg is None:
        return torch.ones_like(x.old_logprobs), mismatch_metrics(x.old_logprobs, x.rollout_logprobs, x.mask)
    return rollout_correction(x.old_logprobs, x.rollout_logprobs, x.mask, cfg)
