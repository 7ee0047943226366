"""Masked reductions over `[B, T]` token tensors, and `aggregate`, the one place per-token terms become a scalar.

A mask is 0/1 (bool or float); a non-zero entry marks a token that counts. Values at masked positions are *selected
away* (`torch.where`), never multiplied by 0, so NaN or inf in padding cannot leak into a result or its gradient.
"""

from __future__ import annotations

from typing import Literal

import torch

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def valid_of(mask: torch.Tensor) -> torch.Tensor:
    """Boolean view of a 0/1 mask `[B, T]`."""
    return mask if mask.dtype == torch.bool else mask != 0


def zero_padding(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` `[B, T]` with masked positions replaced by 0; the gradient at those positions is exactly 0."""
    return torch.where(valid_of(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` `[B, T]` over valid positions (all of them, or along `dim`)."""
    x = zero_padding(x, mask)
    return x.sum() if dim is None else x.sum(dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` `[B, T]` over valid positions; 0 (not NaN) where nothing is valid."""
    count = valid_of(mask).sum() if dim is None else valid_of(mask).sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: Aggregation,
    num_tokens: float | None = None,
    num_seqs: float | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce per-token `values` `[B, T]` to a scalar.

    token_mean               sum_it l_it m_it / sum_it m_it                             (DAPO, arXiv 2503.14476)
    seq_mean_token_mean      mean over non-empty sequences of sum_t l_it m_it / sum_t m_it  (GRPO, arXiv 2402.03300)
    seq_mean_token_sum       mean over non-empty sequences of sum_t l_it m_it
    seq_mean_token_sum_norm  sum_i sum_t l_it m_it / (n_seqs * norm_len)                (Dr. GRPO, arXiv 2503.20783)

    `num_tokens` / `num_seqs` replace the local token count / non-empty-sequence count by global ones, so partial
    results of micro-batches and data-parallel shards *sum* to the full-batch value. `norm_len` defaults to T.
    An empty mask gives 0 with the graph to `values` intact.
    """
    valid = valid_of(mask)
    seq_sums = masked_sum(values, valid, dim=-1)  # [B]
    lengths = valid.sum(-1)  # [B]
    n_seqs = normaliser(num_seqs, (lengths > 0).sum(), values.dtype)
    if mode == "token_mean":
        return seq_sums.sum() / normaliser(num_tokens, lengths.sum(), values.dtype)
    if mode == "seq_mean_token_mean":
        # An empty sequence has sum 0 and contributes 0 (its length is clamped to 1 only to avoid 0/0).
        return (seq_sums / lengths.clamp(min=1).to(values.dtype)).sum() / n_seqs
    if mode == "seq_mean_token_sum":
        return seq_sums.sum() / n_seqs
    if mode == "seq_mean_token_sum_norm":
        # Dr. GRPO divides by a constant length instead of |o_i|, removing the bias towards long wrong answers.
        return seq_sums.sum() / (n_seqs * (norm_len if norm_len is not None else values.shape[-1]))
    raise ValueError(f"unknown aggregation mode {mode!r}; expected one of "
                     "token_mean, seq_mean_token_mean, seq_mean_token_sum, seq_mean_token_sum_norm")


def normaliser(given: float | None, local: torch.Tensor, dtype: torch.dtype) -> float | torch.Tensor:
    """`aggregate`'s divisor: the global count when given, else the local one; at least 1, so empty batches give 0."""
    return max(float(given), 1.0) if given is not None else local.to(dtype).clamp(min=1)
