"""`compute_loss`: the one place where the policy term, the rollout correction, KL and entropy are composed.

Everything is `[B, T]` (B sequences, T padded response tokens). Padding is zeroed in every input first, so values
there (even NaN or inf) cannot change the loss or any gradient. With global `num_tokens` / `num_seqs`, the losses
of micro-batches and data-parallel shards sum to exactly the full-batch loss (see `aggregate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from distrl.algo.correction import mismatch_metrics, rollout_correction
from distrl.algo.kl import kl_estimate
from distrl.algo.masked import aggregate, masked_mean, valid_of, zero_padding
from distrl.algo.policy import policy_term
from distrl.config import CorrectionConfig, LossConfig

_TENSORS = ("logprobs", "old_logprobs", "advantages", "rollout_logprobs", "ref_logprobs", "entropy")


@dataclass
class LossInputs:
    """Per-token inputs `[B, T]` of `compute_loss`, and the global normalisers of a sharded batch.

    logprobs          log pi(o_t) under the current policy; the only input that carries gradient
    old_logprobs      log pi_old(o_t): the trainer before this update (the PPO ratio's denominator)
    advantages        A_t
    mask              1 on response tokens that count, 0 on padding
    rollout_logprobs  log pi_rollout(o_t) from the sampler (vLLM); needed by `loss.correction`
    ref_logprobs      log pi_ref(o_t); needed by a KL term in the loss
    entropy           H_t of the current policy (carries gradient); needed by `loss.entropy_coef > 0`
    num_tokens        valid tokens in the whole (global) batch; null means this shard's own count
    num_seqs          non-empty sequences in the whole batch; null means this shard's own count
    norm_len          seq_mean_token_sum_norm's divisor; overrides `loss.policy.norm_len`; both null means T
    """

    logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    mask: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    num_tokens: float | None = None
    num_seqs: float | None = None
    norm_len: int | None = None

    def validate(self) -> LossInputs:
        if self.logprobs.dim() != 2:
            raise ValueError(f"LossInputs.logprobs must be [B, T], got shape {tuple(self.logprobs.shape)}")
        for name in (*_TENSORS, "mask"):
            x = getattr(self, name)
            if x is not None and x.shape != self.logprobs.shape:
                raise ValueError(f"LossInputs.{name} is {tuple(x.shape)}, logprobs is {tuple(self.logprobs.shape)}")
        return self


@dataclass
class LossOutput:
    """`loss`: scalar tensor to backpropagate. `metrics`: python floats (this shard's means; `loss/*` are partial
    sums of the global loss, so they add up over shards like the loss does)."""

    loss: torch.Tensor
    metrics: dict[str, float] = field(default_factory=dict)


def _require(inputs: LossInputs, cfg: LossConfig) -> None:
    """Fail early, naming the config field that asks for a missing input."""
    if cfg.correction is not None and inputs.rollout_logprobs is None:
        raise ValueError("loss.correction is set but LossInputs.rollout_logprobs is None: pass the sampler's "
                         "log-probs, or set loss.correction to null")
    if _kl_in_loss(cfg) and inputs.ref_logprobs is None:
        raise ValueError(f"loss.kl.coef ({cfg.kl.coef}) > 0 with loss.kl.target 'loss' needs "
                         "LossInputs.ref_logprobs (reference-model log-probs)")
    if cfg.entropy_coef > 0 and inputs.entropy is None:
        raise ValueError(f"loss.entropy_coef ({cfg.entropy_coef}) > 0 needs LossInputs.entropy "
                         "(see distrl.algo.entropy_from_logits)")


def _kl_in_loss(cfg: LossConfig) -> bool:
    return cfg.kl.target == "loss" and cfg.kl.coef > 0


def compute_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """The policy loss of one (micro-)batch:

        loss = aggregate(w * pg) + kl.coef * aggregate(kl) - entropy_coef * aggregate(entropy)

    w          detached rollout-correction weights (`rollout_correction`; 1 when `cfg.correction` is null)
    pg         PPO / GSPO clipped per-token term (`policy_term`) from logprobs, old_logprobs, advantages
    kl         `kl_estimate(logprobs, ref_logprobs, cfg.kl.estimator)`; its term only for kl.target 'loss', coef > 0
    entropy    per-token entropy; its term only for entropy_coef > 0
    aggregate  `cfg.policy.aggregation` (GSPO's is seq_mean_token_mean), divided by the inputs' global normalisers
               when given
    """
    _require(inputs.validate(), cfg)
    x = _without_padding(inputs)
    agg = partial(aggregate, mask=x.mask, mode=cfg.policy.aggregation, num_tokens=x.num_tokens,
                  num_seqs=x.num_seqs, norm_len=x.norm_len or cfg.policy.norm_len)

    w, metrics = _correction_weights(x, cfg.correction)
    pg, clipped, dual_clipped = policy_term(x.logprobs, x.old_logprobs, x.advantages, x.mask,
                                            cfg.policy.type, cfg.policy.clip_low, cfg.policy.clip_high,
                                            cfg.policy.dual_clip)
    kl = None if x.ref_logprobs is None else kl_estimate(x.logprobs, x.ref_logprobs, cfg.kl.estimator)

    zero = pg.new_zeros(())
    policy_loss = agg(w * pg)
    kl_loss = agg(kl) if kl is not None and _kl_in_loss(cfg) else zero
    entropy_loss = agg(x.entropy) if x.entropy is not None and cfg.entropy_coef > 0 else zero
    loss = policy_loss + cfg.kl.coef * kl_loss - cfg.entropy_coef * entropy_loss

    metrics.update({"loss/policy": policy_loss, "loss/kl": kl_loss, "loss/entropy": entropy_loss, "loss/total": loss,
                    "clip_frac": masked_mean(clipped.to(pg.dtype), x.mask),
                    "dual_clip_frac": masked_mean(dual_clipped.to(pg.dtype), x.mask),
                    "ppo_kl": masked_mean((x.old_logprobs - x.logprobs).detach(), x.mask)})
    if kl is not None:
        metrics["kl_ref"] = masked_mean(kl.detach(), x.mask)
    if x.entropy is not None:
        metrics["entropy"] = masked_mean(x.entropy.detach(), x.mask)
    return LossOutput(loss=loss, metrics=_to_floats(metrics))


def _without_padding(inputs: LossInputs) -> LossInputs:
    """The inputs with a boolean mask, every tensor 0 on padding, and the constants detached."""
    mask = valid_of(inputs.mask)
    present = {name: getattr(inputs, name) for name in _TENSORS if getattr(inputs, name) is not None}
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


def _to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-dim tensors to python floats with one device-to-host copy instead of one per metric."""
    values = torch.stack([v.detach().to(torch.float64) for v in metrics.values()]).tolist()
    return dict(zip(metrics, values, strict=True))
