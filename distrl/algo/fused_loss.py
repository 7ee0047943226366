"""The fused forward and backward of `compute_loss`: `reference_loss`'s loss, metrics and gradients in few passes.

Where the time went in `reference_loss` (B=64, T=2048, float32 CPU, PPO + token TIS; `bench/bench_loss.py`): 108
passes over `[B, T]` per forward + backward, 25 of them `torch.where` and 12 boolean-to-float copies (every input
zeroed on padding, then masked again by each masked mean and by the backward of clamp, maximum and where); on this
CPU build `where` costs ~18x a float add and a boolean comparison ~4x. About 3/4 of its CPU time was the forward
with its metrics, 1/4 autograd's backward.

What this path does instead:
- The loss is a sum of per-token functions of `logprobs` (everything else is a constant: GSPO's and GMPO's sequence
  ratios, CISPO's weights, the covariance losses' selection), so d loss / d logprobs_it is that token's own
  derivative times its aggregation weight. The forward pass forms it from values it computes anyway
  (`clipped_surrogate_with_grad` and each type's term in `fused_policy.py`, `kl_estimate_with_grad`); the backward
  pass is one multiplication (`KnownGradient`).
- Padding is zeroed once per input by a bitwise AND of the float's bits with an all-ones / all-zeros integer mask:
  the bits of `torch.where(valid, x, 0)` (NaN and inf in padding become +0) at the cost of an add. Every later
  quantity is then finite and 0 (or harmless) on padding, so nothing is masked twice.
- Indicators (clipped, truncated, dual-clipped, kept) are 0/1 floats (sign() of a non-negative gap, or `torch.eq`
  written into a float tensor), never booleans; counts are sums of 0/1 floats, exact in any summation order; metrics
  share the loss's intermediates; temporaries are reused in place and dropped as soon as they are dead (every fresh
  `[B, T]` tensor costs page faults on CPU).

Exactness: the loss and every metric come from the same operations on the same values in the same order as in
`reference_loss`, so they are equal bit for bit when the valid inputs are finite. The gradients are autograd's
products formed in another order: equal to float rounding (tests: within 1e-6 of the gradient's scale). The one
departure is the subgradient at an exact tie described in `clipped_surrogate_with_grad`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from distrl.algo.correction import correction_with_metrics
from distrl.algo.fused_policy import FUSED, NEEDS_LOGPROBS, TokenTerms
from distrl.algo.kl import kl_estimate_with_grad
from distrl.algo.loss_inputs import LossInputs, kl_in_loss
from distrl.algo.masked import Aggregation, normaliser
from distrl.config import LossConfig

_INT_OF_SIZE = {2: torch.int16, 4: torch.int32, 8: torch.int64}


class Tokens:
    """The valid tokens of a `[B, T]` mask, in the forms the fused loss uses.

    valid    `[B, T]` 1.0 on valid tokens, 0.0 on padding (in `dtype`)
    lengths  `[B]` valid tokens per sequence; count: `()` valid tokens of the batch
    """

    def __init__(self, mask: torch.Tensor, dtype: torch.dtype) -> None:
        # valid_of(mask) written straight into a float tensor: one pass, where bool then float would take two
        self.valid = torch.ne(mask, 0, out=torch.empty(mask.shape, dtype=dtype, device=mask.device))
        self.lengths = self.valid.sum(-1)
        self.count = self.lengths.sum()
        # by element size: -1 (every bit set) on valid tokens, 0 on padding
        self._bits = {4: self.valid.to(torch.int32).neg_()}

    def zero_padding(self, x: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        """`x` `[B, T]` with +0 on padding, bit for bit `torch.where(valid, x, 0)`, NaN and inf included;
        `in_place` overwrites `x` (a temporary of the caller's)."""
        size = x.element_size()
        if not x.is_floating_point() or size not in _INT_OF_SIZE:
            return torch.where(self._bits[4] != 0, x, 0)
        if size not in self._bits:
            self._bits[size] = self._bits[4].to(_INT_OF_SIZE[size])
        bits = self._bits[size]
        if in_place:
            return x.view(bits.dtype).bitwise_and_(bits).view(x.dtype)
        return (x.view(bits.dtype) & bits).view(x.dtype)


class _Aggregate:
    """`aggregate` (masked.py) of per-token values that are already 0 on padding, and its derivative: `coef(s)` is
    d (s * aggregate(values)) / d values_it on valid tokens, a scalar or `[B, 1]`, formed as autograd forms it."""

    def __init__(self, tokens: Tokens, mode: Aggregation, x: LossInputs, norm_len: int | None) -> None:
        dtype = tokens.valid.dtype
        self.mode, self.lengths = mode, tokens.lengths
        self.n_seqs = normaliser(x.num_seqs, (tokens.lengths > 0).sum(), dtype)
        self.n_tokens = normaliser(x.num_tokens, tokens.count, dtype)
        self.norm_len = norm_len if norm_len is not None else tokens.valid.shape[-1]
        if mode not in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
            raise ValueError(f"unknown aggregation mode {mode!r}; expected one of "
                             "token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm")

    def __call__(self, values: torch.Tensor) -> torch.Tensor:
        seq_sums = values.sum(-1)  # [B]
        if self.mode == "token_mean":
            return seq_sums.sum() / self.n_tokens
        if self.mode == "seq_mean_token_mean":
            return (seq_sums / self.lengths.clamp(min=1)).sum() / self.n_seqs
        if self.mode == "seq_mean_token_sum":
            return seq_sums.sum() / self.n_seqs
        return seq_sums.sum() / (self.n_seqs * self.norm_len)

    def coef(self, s: torch.Tensor) -> torch.Tensor:
        if self.mode == "token_mean":
            return s / self.n_tokens
        if self.mode == "seq_mean_token_mean":
            return ((s / self.n_seqs) / self.lengths.clamp(min=1)).unsqueeze(-1)
        if self.mode == "seq_mean_token_sum":
            return s / self.n_seqs
        return s / (self.n_seqs * self.norm_len)


@dataclass
class FusedLoss:
    """The loss (0-dim, no graph), its metrics (0-dim), and d loss / d logprobs and d loss / d entropy `[B, T]`
    (None where not asked for or not in the loss)."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    grad_logprobs: torch.Tensor | None
    grad_entropy: torch.Tensor | None


@torch.no_grad()
def fused_loss(x: LossInputs, cfg: LossConfig, grad_logprobs: bool, grad_entropy: bool) -> FusedLoss:
    """`reference_loss`'s loss and metrics, with the gradients it would give when asked for (see module doc)."""
    dtype = torch.result_type(x.logprobs, x.old_logprobs)
    tokens = Tokens(x.mask, dtype)
    agg = _Aggregate(tokens, cfg.policy.aggregation, x, x.norm_len or cfg.policy.norm_len)
    one, count = torch.ones((), dtype=dtype, device=x.logprobs.device), tokens.count.clamp(min=1)
    needs_logprobs = cfg.policy.type in NEEDS_LOGPROBS or x.ref_logprobs is not None
    logprobs = tokens.zero_padding(x.logprobs.detach()) if needs_logprobs else None

    metrics: dict[str, torch.Tensor] = {}
    weights = None
    if x.rollout_logprobs is not None:
        d = tokens.zero_padding(x.old_logprobs.detach() - x.rollout_logprobs.detach(), in_place=True)
        weights, metrics = correction_with_metrics(d, tokens.valid, tokens.lengths, cfg.correction)
        del d  # [B, T] temporaries are freed as soon as they are dead: fewer fresh pages, less time
    policy_loss, grad, policy_metrics = _policy(x, cfg, tokens, agg, logprobs, weights, grad_logprobs)
    del weights
    zero = policy_loss.new_zeros(())
    kl_loss = zero
    if x.ref_logprobs is not None:
        assert logprobs is not None
        kl_upstream = agg.coef(one * cfg.kl.coef) * tokens.valid if grad_logprobs and kl_in_loss(cfg) else None
        kl, kl_grad = kl_estimate_with_grad(logprobs, tokens.zero_padding(x.ref_logprobs.detach()), cfg.kl.estimator,
                                            kl_upstream)
        kl_loss = agg(kl) if kl_in_loss(cfg) else zero
        policy_metrics["kl_ref"] = kl.sum() / count
        if grad is not None and kl_grad is not None:
            grad += kl_grad
    entropy_loss, entropy_grad = zero, None
    if x.entropy is not None:
        entropy = tokens.zero_padding(x.entropy.detach())
        policy_metrics["entropy"] = entropy.sum() / count
        if cfg.entropy_coef > 0:
            entropy_loss = agg(entropy)
            if grad_entropy:
                entropy_grad = (agg.coef(-one * cfg.entropy_coef) * tokens.valid).to(x.entropy.dtype)
    loss = policy_loss + cfg.kl.coef * kl_loss - cfg.entropy_coef * entropy_loss
    metrics.update({"loss/policy": policy_loss, "loss/kl": kl_loss, "loss/entropy": entropy_loss, "loss/total": loss,
                    **policy_metrics})
    return FusedLoss(loss, metrics, None if grad is None else grad.to(x.logprobs.dtype), entropy_grad)


def _policy(x: LossInputs, cfg: LossConfig, tokens: Tokens, agg: _Aggregate, logprobs: torch.Tensor | None,
            weights: torch.Tensor | None, grad_logprobs: bool,
            ) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]]:
    """aggregate(w * pg), its gradient with respect to logprobs `[B, T]` (or None), and the policy's figures with
    ppo_kl (`fused_policy.FUSED`, by `cfg.policy.type`). `logprobs`: zeroed on padding (the types in
    `NEEDS_LOGPROBS` read it)."""
    if cfg.policy.type not in FUSED:
        raise ValueError(f"unknown policy loss {cfg.policy.type!r}; expected one of {', '.join(FUSED)}")
    count = tokens.count.clamp(min=1)
    diff = tokens.zero_padding(x.logprobs.detach() - x.old_logprobs.detach(), in_place=True)  # log pi - log pi_old
    ppo_kl = -diff.sum() / count
    selected = None if x.cov_selected is None else tokens.zero_padding(x.cov_selected.detach().to(count.dtype))
    upstream = agg.coef(torch.ones((), dtype=count.dtype, device=count.device)) if grad_logprobs else None
    terms = TokenTerms(diff, logprobs, tokens.zero_padding(x.advantages.detach()), tokens.valid, tokens.lengths,
                       count, selected, upstream)
    pg, grad, metrics = FUSED[cfg.policy.type](terms, cfg.policy)
    del terms, diff
    if weights is not None:  # d (w pg) / d pg = w
        pg.mul_(weights)
        if grad is not None:
            grad.mul_(weights)
    return agg(pg), grad, {**metrics, "ppo_kl": ppo_kl}


class KnownGradient(torch.autograd.Function):
    """A scalar whose gradients with respect to `logprobs` and `entropy` were formed in the forward pass: backward
    scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor | None,
                grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(grad_logprobs, grad_entropy)
        return value.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_logprobs, grad_entropy = ctx.saved_tensors
        return (None, None if grad_logprobs is None else grad_logprobs * grad,
                None if grad_entropy is None else grad_entropy * grad, None, None)
