"""Sampled-token log-probs and entropies from logits `[B, T, V]` without a full `[B, T, V]` float32 log-softmax.

`log_softmax(logits.float() / temperature).gather(...)` keeps two or three `[B, T, V]` float32 tensors alive (the
upcast, the log-softmax saved for backward, the gradient of the gather); with V ~ 150k that is gigabytes per
micro-batch. Here forward visits row chunks, keeps only the `[B, T]` logsumexp, and saves the logits themselves
(no copy); backward recomputes the softmax chunk by chunk and writes into one gradient buffer of the logits' dtype.
The idea of Liger-Kernel's chunked cross-entropy, in plain torch. Arithmetic is float32 (float64 for float64 logits,
which `gradcheck` uses).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

DEFAULT_CHUNK_ROWS = 512
"""Rows (B x T positions) per chunk: 512 x 152k vocabulary x 4 bytes ~ 300 MB of float32 scratch at a time."""


def _blocks(b: int, t: int, rows: int) -> Iterator[tuple[slice, slice]]:
    """(batch, time) slices of about `rows` positions each. Slicing two leading dims (instead of flattening to
    [B*T, V]) keeps every chunk a view, also for non-contiguous logits such as `model(...).logits[:, p:p+t]`."""
    if rows >= t:
        step = rows // t
        for i in range(0, b, step):
            yield slice(i, i + step), slice(None)
    else:
        for i in range(b):
            for j in range(0, t, rows):
                yield slice(i, i + 1), slice(j, j + rows)


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A fresh compute-dtype copy of `chunk` divided by the temperature (safe to modify in place)."""
    x = chunk.to(torch.promote_types(chunk.dtype, torch.float32), copy=True)
    return x.div_(temperature) if temperature != 1.0 else x


def _chunk_log_softmax(chunk: torch.Tensor, temperature: float, lse: torch.Tensor) -> torch.Tensor:
    """log softmax(chunk / temperature) `[b, t, V]` in the compute dtype, from the chunk's saved logsumexp `[b, t]`."""
    return _scaled(chunk, temperature).sub_(lse.unsqueeze(-1))


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, ids: torch.Tensor, temperature: float, rows: int) -> torch.Tensor:
        b, t, _ = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty((b, t), dtype=dtype, device=logits.device)
        out = torch.empty((b, t), dtype=dtype, device=logits.device)
        for bs, ts in _blocks(b, t, rows):
            x = _scaled(logits[bs, ts], temperature)
            lse[bs, ts] = torch.logsumexp(x, -1)
            out[bs, ts] = x.gather(-1, ids[bs, ts].unsqueeze(-1)).squeeze(-1) - lse[bs, ts]
        ctx.save_for_backward(logits, ids, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, ids, lse = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for bs, ts in _blocks(lse.shape[0], lse.shape[1], ctx.rows):
            g = grad_out[bs, ts].to(lse.dtype).unsqueeze(-1)
            # d log p_y / d z_j = (1[j = y] - p_j) / temperature
            p = _chunk_log_softmax(logits[bs, ts], ctx.temperature, lse[bs, ts]).exp_()
            p.mul_(-g).scatter_add_(-1, ids[bs, ts].unsqueeze(-1), g)
            grad[bs, ts] = p.div_(ctx.temperature) if ctx.temperature != 1.0 else p
        return grad, None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, temperature: float, rows: int) -> torch.Tensor:
        b, t, _ = logits.shape
        dtype = torch.promote_types(logits.dtype, torch.float32)
        lse = torch.empty((b, t), dtype=dtype, device=logits.device)
        entropy = torch.empty((b, t), dtype=dtype, device=logits.device)
        for bs, ts in _blocks(b, t, rows):
            logp = _scaled(logits[bs, ts], temperature)
            lse[bs, ts] = torch.logsumexp(logp, -1)
            logp.sub_(lse[bs, ts].unsqueeze(-1))
            entropy[bs, ts] = -logp.exp().mul_(logp).sum(-1)  # H = -sum_j p_j log p_j
        ctx.save_for_backward(logits, lse, entropy)
        ctx.temperature, ctx.rows = temperature, rows
        return entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, lse, entropy = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for bs, ts in _blocks(lse.shape[0], lse.shape[1], ctx.rows):
            g = grad_out[bs, ts].to(lse.dtype).unsqueeze(-1)
            # dH / dz_j = -p_j (log p_j + H) / temperature
            logp = _chunk_log_softmax(logits[bs, ts], ctx.temperature, lse[bs, ts])
            p = logp.exp()
            d = logp.add_(entropy[bs, ts].unsqueeze(-1)).mul_(p).mul_(-g)
            grad[bs, ts] = d.div_(ctx.temperature) if ctx.temperature != 1.0 else d
        return grad, None, None


def _as_3d(logits: torch.Tensor) -> torch.Tensor:
    """`[B, T, V]` as it is; `[N, V]` as a view `[1, N, V]`."""
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [B, T, V] (or [N, V]), got shape {tuple(logits.shape)}")
    return logits if logits.dim() == 3 else logits.unsqueeze(0)


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """log softmax(logits / temperature)[ids]: `[B, T]` float32 (float64 for float64 logits) from logits
    `[B, T, V]` (any float dtype, any strides) and token ids `[B, T]`; `chunk_size` rows at a time."""
    if ids.shape != logits.shape[:-1]:
        raise ValueError(f"ids {tuple(ids.shape)} must match logits {tuple(logits.shape)} without the vocab dim")
    if temperature <= 0 or chunk_size <= 0:
        raise ValueError(f"temperature ({temperature}) and chunk_size ({chunk_size}) must be > 0")
    logits3 = _as_3d(logits)
    ids3 = ids.long().reshape(logits3.shape[:-1])
    return _TokenLogprobs.apply(logits3, ids3, float(temperature), int(chunk_size)).view(ids.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0,
                        chunk_size: int = DEFAULT_CHUNK_ROWS) -> torch.Tensor:
    """Entropy of softmax(logits / temperature): `[B, T]` float32 (float64 for float64 logits) from finite logits
    `[B, T, V]`; `chunk_size` rows at a time, with a chunked backward of its own."""
    if temperature <= 0 or chunk_size <= 0:
        raise ValueError(f"temperature ({temperature}) and chunk_size ({chunk_size}) must be > 0")
    return _Entropy.apply(_as_3d(logits), float(temperature), int(chunk_size)).view(logits.shape[:-1])
