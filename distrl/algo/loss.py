"""`compute_loss`: the one place where the policy term, the rollout correction, KL and entropy are composed.

Everything is `[B, T]` (B sequences, T padded response tokens). Padding is zeroed in every input first, so values
there (even NaN or inf) cannot change the loss or any gradient. With global `num_tokens` / `num_seqs`, the losses
of micro-batches and data-parallel shards sum to exactly the full-batch loss (see `aggregate`).

The objective is defined by `reference_loss` (loss_reference.py), the plain composition of the small functions under
autograd; `compute_loss` computes the same loss, metrics and gradients in a fused pass (fused_loss.py), ~3x faster
on CPU. Deliberate departure from the design guide's "compose three functions here": speed, with the composition
kept as the definition that tests hold the fused path to, on every mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from distrl.algo import correction
from distrl.algo.fused_loss import KnownGradient, fused_loss
from distrl.algo.loss_inputs import LossInputs, require_inputs
from distrl.config import LossConfig
from distrl.merging import Figure, Figures, Merge

__all__ = ["MERGE", "LossInputs", "LossOutput", "compute_loss"]

MERGE = {**correction.MERGE,
         # partial sums of the global loss (global normalisers): they add up over micro-batches and learners
         "loss/policy": Merge.SUM, "loss/kl": Merge.SUM, "loss/entropy": Merge.SUM, "loss/total": Merge.SUM,
         "clip_frac": Merge.TOKEN_MEAN, "dual_clip_frac": Merge.TOKEN_MEAN, "ppo_kl": Merge.TOKEN_MEAN,
         "kl_ref": Merge.TOKEN_MEAN, "entropy": Merge.TOKEN_MEAN,
         # the other losses' own figures (`policy_terms.py`): seq_ratio_mean is weighted by the sequences' tokens
         "cov_frac": Merge.TOKEN_MEAN, "gate_mean": Merge.TOKEN_MEAN, "gated_frac": Merge.TOKEN_MEAN,
         "seq_ratio_mean": Merge.TOKEN_MEAN, "seq_ratio_min": Merge.MIN, "seq_ratio_max": Merge.MAX}
"""How each metric of `compute_loss` merges over micro-batches and learners (`distrl.merging`)."""


@dataclass
class LossOutput:
    """`loss`: scalar tensor to backpropagate. `tensors`: this shard's figures as 0-dim tensors on the loss's device
    (each merges by `MERGE`: `loss/*` are partial sums of the global loss, which add up over shards like the loss
    does, the rest token means, minima and maxima); a trainer keeps them there and reads them once per optimizer
    step. `metrics`: the same as `Figures`, read now (one copy to the host, a wait on a GPU)."""

    loss: torch.Tensor
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def metrics(self) -> Figures:
        return _figures(self.tensors)


def compute_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """The policy loss of one (micro-)batch:

        loss = aggregate(w * pg) + kl.coef * aggregate(kl) - entropy_coef * aggregate(entropy)

    w          detached rollout-correction weights (`rollout_correction`; 1 when `cfg.correction` is null)
    pg         the per-token term of `cfg.policy.type` (`policy_term`: PPO, GSPO, CISPO, SAPO, GMPO, GPG, Clip-Cov,
               KL-Cov) from logprobs, old_logprobs, advantages (and cov_selected, for the covariance losses)
    kl         `kl_estimate(logprobs, ref_logprobs, cfg.kl.estimator)`; its term only for kl.target 'loss', coef > 0
    entropy    per-token entropy; its term only for entropy_coef > 0
    aggregate  `cfg.policy.aggregation` (GSPO's and GMPO's is seq_mean_token_mean), divided by the inputs' global
               normalisers when given

    Gradient flows to `logprobs` and `entropy` only, as in `reference_loss`.
    """
    require_inputs(inputs.validate(), cfg)
    grad_on = torch.is_grad_enabled()
    lp_grad = grad_on and inputs.logprobs.requires_grad
    entropy_grad = grad_on and inputs.entropy is not None and inputs.entropy.requires_grad
    out = fused_loss(inputs, cfg, lp_grad, entropy_grad)
    loss = out.loss
    if out.grad_logprobs is not None or out.grad_entropy is not None:
        loss = KnownGradient.apply(out.loss, inputs.logprobs, inputs.entropy, out.grad_logprobs, out.grad_entropy)
    return LossOutput(loss=loss, tensors=out.metrics)


def _figures(metrics: dict[str, torch.Tensor]) -> Figures:
    """0-dim tensors to Figures with one device-to-host copy instead of one per metric."""
    if not metrics:
        return {}
    values = torch.stack([v.to(torch.float64) for v in metrics.values()]).tolist()
    return {key: Figure(value, MERGE[key]) for key, value in zip(metrics, values, strict=True)}
