"""The LM head, the sampled tokens' log-probs and the entropy in one chunked pass: no `[K, V]` logits ever exist.

`token_logprobs(hidden @ W.T, ...)` needs the `[K, V]` logits of the K predicted positions (V ~ 150k: gigabytes per
micro-batch) and keeps them for the backward pass. Here the forward pass visits chunks of tokens: a chunk's logits
`[c, V]` are made in the compute dtype, upcast to float32, reduced to the chunk's logsumexp, log-probs and entropies,
and dropped; only `hidden`, `W` and the `[K]` logsumexp (and entropy) are saved. The backward pass makes each
chunk's logits again (one more matrix product, the price of never keeping them) and turns them into the chunk's
gradients with respect to the hidden states and the head's weight. When all K tokens fit in one chunk (a small
vocabulary, as on the CPU test models, or few tokens), that chunk's logits are kept for the backward pass instead:
memory stays within one chunk's bytes either way, and the second head product, a few percent of a small model's
step, is saved. The idea of Liger-Kernel's fused linear cross
entropy and of Apple's cut-cross-entropy, in plain torch, with the entropy as well (neither library gives it).

With temperature tau and logits z = W h (+ b), x = z / tau, log p = x - logsumexp(x):
    d log p_y / d x_j = 1[j = y] - p_j
    H = -sum_j p_j log p_j,  d H / d x_j = -p_j (log p_j + H)
and d / d z = (d / d x) / tau. Arithmetic is float32 (float64 for float64 inputs, which `gradcheck` uses).
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK_BYTES = 256 * 2**20
"""Float32 scratch of one chunk's logits: a chunk holds about this many bytes of `[c, V]` (c = 441 tokens for a
vocabulary of 152k; the whole batch at once for a tiny one)."""


def chunk_tokens(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk for a vocabulary of `vocab`: `chunk_bytes` of float32 logits."""
    return max(1, chunk_bytes // (4 * vocab))


def _scaled_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   temperature: float) -> torch.Tensor:
    """x = (h W^T + b) / tau `[c, V]` in the compute dtype's float32 promotion (a fresh tensor)."""
    z = h @ weight.T if bias is None else torch.addmm(bias, h, weight.T)
    x = z.to(torch.promote_types(z.dtype, torch.float32))
    return x.div_(temperature) if temperature != 1.0 else x


class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, temperature: float, chunk: int, with_entropy: bool,
                ) -> tuple[torch.Tensor, torch.Tensor]:
        k = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logprobs = torch.empty(k, dtype=dtype, device=hidden.device)
        lse = torch.empty(k, dtype=dtype, device=hidden.device)
        entropy = torch.empty(k if with_entropy else 0, dtype=dtype, device=hidden.device)
        kept = None
        for s in range(0, k, chunk):
            x = _scaled_logits(hidden[s:s + chunk], weight, bias, temperature)
            lse[s:s + chunk] = torch.logsumexp(x, -1)
            logprobs[s:s + chunk] = x.gather(-1, targets[s:s + chunk, None]).squeeze(-1) - lse[s:s + chunk]
            if with_entropy:  # H = logsumexp(x) - sum_j p_j x_j
                p = x.sub(lse[s:s + chunk, None]).exp_()
                entropy[s:s + chunk] = lse[s:s + chunk] - (p * x).sum(-1)
            kept = x if k <= chunk else None  # one chunk holds every token: its logits serve the backward too
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy, kept)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(lse)
        return logprobs, entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None,
                 ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse, entropy, kept = ctx.saved_tensors
        tau, chunk = ctx.temperature, ctx.chunk
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # Accumulated over chunks in float32 at least: each chunk adds a partial sum over its tokens.
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_weight = torch.zeros(weight.shape, dtype=acc, device=weight.device) if ctx.needs_input_grad[1] else None
        grad_bias = (torch.zeros(bias.shape, dtype=acc, device=bias.device)
                     if bias is not None and ctx.needs_input_grad[2] else None)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s:s + chunk]
            logp = (kept.sub(lse[:, None]) if kept is not None
                    else _scaled_logits(h, weight, bias, tau).sub_(lse[s:s + chunk, None]))
            p = logp.exp()
            dx = torch.zeros_like(p)
            if grad_entropy is not None and entropy.numel():  # -p_j (log p_j + H) g_H
                dx = logp.add_(entropy[s:s + chunk, None]).mul_(p).mul_(-grad_entropy[s:s + chunk, None].to(p.dtype))
            if grad_logprobs is not None:  # (1[j = y] - p_j) g_y
                g = grad_logprobs[s:s + chunk, None].to(p.dtype)
                dx.sub_(p.mul_(g)).scatter_add_(-1, targets[s:s + chunk, None], g)
            dz = (dx.div_(tau) if tau != 1.0 else dx).to(hidden.dtype)
            if grad_hidden is not None:
                grad_hidden[s:s + chunk] = dz @ weight
            if grad_weight is not None:
                grad_weight.add_(dz.T @ h)
            if grad_bias is not None:
                grad_bias.add_(dz.sum(0))
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None, None)


def linear_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    bias: torch.Tensor | None = None, with_entropy: bool = False, chunk_size: int | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax((hidden W^T + b) / temperature)[targets] `[K]` and, with `with_entropy`, the entropy of that
    distribution `[K]`, both float32 (float64 for float64 inputs), from `hidden [K, H]` and the head's `weight
    [V, H]` (and `bias [V]`) in one compute dtype (cast the weight before: the cast is then made once, and its
    gradient flows to the master weight), `chunk_size` tokens at a time (default: `chunk_tokens(V)`). Gradients
    flow to `hidden`, `weight` and `bias` (module docstring)."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [K, H] and weight {tuple(weight.shape)} [V, H]")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets {tuple(targets.shape)} must be [K] for hidden {tuple(hidden.shape)}")
    if weight.dtype != hidden.dtype or (bias is not None and bias.dtype != hidden.dtype):
        raise ValueError(f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share one dtype")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    chunk = chunk_size or chunk_tokens(weight.shape[0])
    logprobs, entropy = _LinearLogprobs.apply(hidden, weight, bias, targets.long(), float(temperature), int(chunk),
                                              with_entropy)
    return logprobs, entropy if with_entropy else None
