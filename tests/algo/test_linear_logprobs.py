"""The chunked LM head (`linear_logprobs`): its log-probs and entropies equal the plain path's (full logits, then
log-softmax), by hand on a two-token example, against the plain path with gradients in float32, by `gradcheck` in
float64 (several chunk sizes, a bias, a temperature), and it never makes `[K, V]` logits."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from distrl.algo import linear_logprobs
from distrl.algo.linear_logprobs import chunk_tokens


def plain(hidden, weight, targets, temperature=1.0, bias=None):
    """The reference: all logits, then log-softmax and the entropy."""
    logits = torch.nn.functional.linear(hidden, weight, bias) / temperature
    logp = logits.log_softmax(-1)
    return logp.gather(-1, targets[:, None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_by_hand_two_tokens():
    # h = [1], W = [[0], [ln 3]]: logits [0, ln 3], p = [1/4, 3/4]; targets 1 then 0.
    hidden = torch.tensor([[1.0], [1.0]])
    weight = torch.tensor([[0.0], [math.log(3.0)]])
    lp, ent = linear_logprobs(hidden, weight, torch.tensor([1, 0]), with_entropy=True, chunk_size=1)
    torch.testing.assert_close(lp, torch.tensor([math.log(0.75), math.log(0.25)]))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))
    torch.testing.assert_close(ent, torch.tensor([h, h]))


@pytest.mark.parametrize("chunk", [1, 3, 7, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradients_equal_the_plain_path(chunk, temperature):
    g = torch.Generator().manual_seed(0)
    k, h, v = 7, 5, 11
    hidden = torch.randn(k, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    bias = torch.randn(v, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (k,), generator=g)
    up_lp, up_ent = torch.randn(k, generator=g), torch.randn(k, generator=g)
    lp, ent = linear_logprobs(hidden, weight, targets, temperature, bias=bias, with_entropy=True, chunk_size=chunk)
    grads = torch.autograd.grad((lp * up_lp).sum() + (ent * up_ent).sum(), (hidden, weight, bias))
    lp0, ent0 = plain(hidden, weight, targets, temperature, bias)
    grads0 = torch.autograd.grad((lp0 * up_lp).sum() + (ent0 * up_ent).sum(), (hidden, weight, bias))
    torch.testing.assert_close(lp, lp0)
    torch.testing.assert_close(ent, ent0)
    for a, b in zip(grads, grads0, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [2, 5])  # 5 tokens: 3 chunks (the backward makes the logits again), or 1 (kept)
@pytest.mark.parametrize("with_entropy", [False, True])
def test_gradcheck_float64(with_entropy, chunk):
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 3, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(6, 3, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(6, dtype=torch.float64, generator=g, requires_grad=True)
    targets = torch.randint(0, 6, (5,), generator=g)

    def f(hh, ww, bb):
        lp, ent = linear_logprobs(hh, ww, targets, 0.8, bias=bb, with_entropy=with_entropy, chunk_size=chunk)
        return (lp, ent) if with_entropy else lp

    assert torch.autograd.gradcheck(f, (hidden, weight, bias))


def test_only_the_log_probs_gradient_when_entropy_is_unused():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(4, 3, generator=g, requires_grad=True)
    weight = torch.randn(9, 3, generator=g)
    targets = torch.randint(0, 9, (4,), generator=g)
    lp, _ = linear_logprobs(hidden, weight, targets, with_entropy=True, chunk_size=3)
    (grad,) = torch.autograd.grad(lp.sum(), hidden)  # the entropy output takes no part
    lp0, _ = plain(hidden, weight, targets)
    (grad0,) = torch.autograd.grad(lp0.sum(), hidden)
    torch.testing.assert_close(grad, grad0)


def test_no_token_vocab_logits_tensor_is_made():
    """Chunks of 2 tokens: no tensor of the forward and backward passes holds more than 2 x V logits (a negative
    control, the plain path, makes [K, V])."""
    k, h, v = 16, 3, 64
    hidden = torch.randn(k, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (k,))

    def largest(fn) -> int:
        sizes = []

        class Watch(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, tuple) else (out,):
                    if isinstance(t, torch.Tensor) and t.dim() == 2 and t.shape[-1] == v and t.shape[0] != h:  # not W^T
                        sizes.append(t.shape[0])
                return out

        with Watch():
            lp = fn()
            lp.sum().backward()
        return max(sizes, default=0)

    assert largest(lambda: linear_logprobs(hidden, weight, targets, chunk_size=2)[0]) <= 2
    assert largest(lambda: plain(hidden, weight, targets)[0]) == k


def test_one_chunk_keeps_its_logits_for_the_backward_pass(monkeypatch):
    """Chunks of logits made (`_scaled_logits`, a head product each): with every token in one chunk, the forward
    pass's one, kept for the backward pass; with two chunks, each made again in the backward pass: 2 + 2. The
    gradients agree, and a second backward pass through the kept logits gives the same ones (they are not changed
    in place)."""
    module = sys.modules[linear_logprobs.__module__]  # distrl.algo re-exports the function under the module's name
    made = []
    scaled_logits = module._scaled_logits
    monkeypatch.setattr(module, "_scaled_logits", lambda *args: made.append(1) or scaled_logits(*args))
    g = torch.Generator().manual_seed(2)
    k, h, v = 6, 4, 9
    hidden = torch.randn(k, h, generator=g, requires_grad=True)
    weight = torch.randn(v, h, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (k,), generator=g)

    def gradients(chunk: int) -> tuple[int, tuple[torch.Tensor, ...]]:
        made.clear()
        lp, ent = linear_logprobs(hidden, weight, targets, 0.9, with_entropy=True, chunk_size=chunk)
        grads = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight), retain_graph=True)
        count = len(made)
        again = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
        for a, b in zip(grads, again, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        return count, grads

    kept, grads_kept = gradients(chunk=k)
    made_again, grads_again = gradients(chunk=3)
    assert (kept, made_again) == (1, 4)
    for a, b in zip(grads_kept, grads_again, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_refuses_mixed_dtypes_and_bad_shapes():
    with pytest.raises(ValueError, match="share one dtype"):
        linear_logprobs(torch.randn(2, 3), torch.randn(4, 3, dtype=torch.float64), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must be \[K\]"):
        linear_logprobs(torch.randn(2, 3), torch.randn(4, 3), torch.zeros(3, dtype=torch.long))


def test_chunk_size_follows_the_vocabulary():
    assert chunk_tokens(151936) == 256 * 2**20 // (4 * 151936) == 441
    assert chunk_tokens(2**40) == 1
