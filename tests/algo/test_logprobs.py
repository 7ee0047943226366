"""token_logprobs / entropy_from_logits against the naive full log-softmax, gradcheck, and what backward keeps."""

import pytest
import torch

from distrl.algo import entropy_from_logits, token_logprobs


def _naive(logits, ids, temperature):
    logp = torch.log_softmax(logits.float() / temperature, -1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _case(dtype=torch.float32, b=3, t=7, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    # a slice of a longer sequence, as the model's logits[:, p - 1 : p - 1 + t] are: non-contiguous
    full = torch.randn(b, t + 4, v, generator=g) * 3
    logits = full[:, 2 : 2 + t].to(dtype).requires_grad_()
    ids = torch.randint(0, v, (b, t), generator=g)
    return logits, ids, torch.randn(b, t, generator=g)


# Tolerance 1e-6 absolute plus 1e-6 relative: one float32 ulp at |log p| ~ 20 is already 2e-6.
@pytest.mark.parametrize("chunk_size", [1, 3, 7, 10, 1000])  # within a row, row-sized, several rows, all rows
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_matches_naive_float32(chunk_size, temperature):
    logits, ids, weights = _case()
    naive_lp, naive_h = _naive(logits, ids, temperature)
    naive_grads = torch.autograd.grad(((naive_lp + naive_h) * weights).sum(), logits, retain_graph=True)[0]
    lp = token_logprobs(logits, ids, temperature=temperature, chunk_size=chunk_size)
    h = entropy_from_logits(logits, temperature=temperature, chunk_size=chunk_size)
    assert lp.dtype == h.dtype == torch.float32 and lp.shape == h.shape == ids.shape
    torch.testing.assert_close(lp, naive_lp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h, naive_h, rtol=1e-6, atol=1e-6)
    grad_lp = torch.autograd.grad((lp * weights).sum(), logits)[0]
    grad_h = torch.autograd.grad((h * weights).sum(), logits)[0]
    torch.testing.assert_close(grad_lp + grad_h, naive_grads, rtol=1e-6, atol=1e-6)
    # each on its own too
    naive_grad_lp = torch.autograd.grad((naive_lp * weights).sum(), logits)[0]
    torch.testing.assert_close(grad_lp, naive_grad_lp, rtol=1e-6, atol=1e-6)


def test_bfloat16_logits():
    logits, ids, weights = _case(torch.bfloat16)
    naive_lp, naive_h = _naive(logits, ids, 0.8)  # upcast to float32 first, as a careful caller would
    lp = token_logprobs(logits, ids, temperature=0.8, chunk_size=4)
    h = entropy_from_logits(logits, temperature=0.8, chunk_size=4)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, naive_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(h, naive_h, rtol=0, atol=1e-5)
    for ours, naive in ((lp, naive_lp), (h, naive_h)):
        grad = torch.autograd.grad((ours * weights).sum(), logits)[0]
        expected = torch.autograd.grad((naive * weights).sum(), logits, retain_graph=True)[0]
        assert grad.dtype == torch.bfloat16
        # both are float32 gradients rounded to bfloat16 (8 bits of mantissa)
        torch.testing.assert_close(grad.float(), expected.float(), rtol=1e-2, atol=1e-3)


def test_two_dimensional_logits():
    logits, ids, _ = _case(b=1)
    lp = token_logprobs(logits[0], ids[0], chunk_size=2)
    assert lp.shape == (7,)
    torch.testing.assert_close(lp, _naive(logits[0], ids[0], 1.0)[0], rtol=1e-6, atol=1e-6)
    assert entropy_from_logits(logits[0], chunk_size=2).shape == (7,)


def test_gradcheck_float64():
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda z: token_logprobs(z, ids, temperature=0.6, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda z: entropy_from_logits(z, temperature=1.3, chunk_size=4), (logits,))


def test_backward_keeps_no_vocab_sized_float32_copy():
    # Everything saved for backward: the logits themselves (same storage), ids, and [B, T] tensors. The naive
    # log_softmax(...).gather saves its [B, T, V] float32 output, which this test rejects.
    logits, ids, _ = _case(torch.bfloat16, v=64)
    saved = []

    def pack(x):
        saved.append(x)
        return x

    for fn in (lambda: token_logprobs(logits, ids), lambda: entropy_from_logits(logits)):
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            fn()
        big = [x for x in saved if x.numel() >= logits.numel()]
        assert big and all(x.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr() for x in big)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        _naive(logits, ids, 1.0)
    assert any(x.numel() >= logits.numel() and x.dtype == torch.float32 for x in saved)


def test_rejects_bad_arguments():
    logits, ids, _ = _case()
    with pytest.raises(ValueError, match="ids"):
        token_logprobs(logits, ids[:, :3])
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, ids, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        entropy_from_logits(logits, chunk_size=0)
