"""Ulysses sequence parallelism (Jacobs et al. 2023, "DeepSpeed Ulysses"): the k learners of a group share one packed
micro-batch, each holding a contiguous slice of its N tokens (N padded to a multiple of k) through every layer, and
exchange heads for tokens around attention, the one place a token needs the others:

    q, k, v [1, H, N/k, D] on each learner  --all-to-all-->  [1, H/k, N, D]: every token, 1/k of the heads
    attention within each packed sequence (`packed_attention`, the whole row's pack)  ->  [1, N, H/k, D]
    --all-to-all-->  [1, N/k, H, D]: back to this learner's tokens, every head

Everything else (embeddings, norms, projections, MLPs, the chunked LM head) is per token and runs on the slice
alone, so activations per learner fall about k-fold. The H query heads and the key/value heads must both divide by k
(a learner's slice of the query heads then uses exactly its slice of the key/value heads).

The log-probs of the response tokens each learner's slice predicts are gathered over the group (`gather_kept`), so
every learner of the group computes the same loss on the whole micro-batch, once per learner; the gather's backward
keeps only this learner's part of the loss's gradient, so each learner's backward is the gradient through its own
slice, and the sum over the group (FSDP's reduce-scatter, or the replicas' all-reduce, over every learner) is the
unsplit micro-batch's gradient exactly. (verl's `ulysses` module does the same exchange as a patch of transformers'
flash-attention function; here it is part of distrl's own packed attention, which every trained model runs.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SequenceSplit:
    """This learner's place in its sequence-parallel group: `rank` of `size`, the collectives over `group` (None:
    the default group, every learner)."""

    group: Any
    size: int
    rank: int


def exchange(x: torch.Tensor, split: SequenceSplit, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """All-to-all over the group: `x` cut into k equal chunks along `scatter_dim`, chunk j sent to learner j, the k
    chunks received concatenated along `gather_dim` in the group's order (differentiable: the backward is the
    exchange the other way)."""
    return _Exchange.apply(x, split, scatter_dim, gather_dim)


def _all_to_all(x: torch.Tensor, split: SequenceSplit, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    chunks = [c.contiguous() for c in x.chunk(split.size, dim=scatter_dim)]
    received = [torch.empty_like(c) for c in chunks]
    dist.all_to_all(received, chunks, group=split.group)
    return torch.cat(received, dim=gather_dim)


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, split, scatter_dim, gather_dim):
        ctx.split, ctx.dims = split, (scatter_dim, gather_dim)
        return _all_to_all(x, split, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.split, gather_dim, scatter_dim), None, None, None


def heads_to_tokens(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """`[B, heads, N/k, D]` (this learner's tokens, every head) to `[B, heads/k, N, D]` (every token, its heads)."""
    if x.shape[1] % split.size:
        raise ValueError(f"learner.sequence_parallel_size {split.size} does not divide the model's {x.shape[1]} "
                         f"attention (or key/value) heads")
    return exchange(x, split, scatter_dim=1, gather_dim=2)


def tokens_to_heads(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """Attention's output `[B, N, heads/k, D]` (every token, this learner's heads) to `[B, N/k, heads, D]`."""
    return exchange(x, split, scatter_dim=1, gather_dim=2)


def gather_kept(x: torch.Tensor, kept: tuple[int, ...], split: SequenceSplit) -> torch.Tensor:
    """This learner's values `[kept[rank], ...]` and the other learners' of the group, concatenated in the group's
    order: `[sum(kept), ...]` on every learner. The backward returns only this learner's rows of the gradient (each
    learner computes the same loss of the whole; see the module docstring)."""
    return _Gather.apply(x, kept, split)


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, kept, split):
        ctx.start, ctx.count = sum(kept[:split.rank]), kept[split.rank]
        most = max(*kept, 1)  # all_gather takes equal sizes: each part padded to the largest
        padded = x.new_zeros(most, *x.shape[1:])
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in kept]
        dist.all_gather(parts, padded.contiguous(), group=split.group)
        return torch.cat([part[:n] for part, n in zip(parts, kept, strict=True)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start:ctx.start + ctx.count], None, None
