"""kl_estimate: Schulman (2020) k1, k2, k3 and the straight-through k3+."""

import math

import pytest
import torch

from distrl.algo import kl_estimate

# x = logprobs - ref_logprobs = [1, 0, -2, 15 (clamped to 10)]
LOGPROBS = torch.tensor([[-1.0, -2.0, -4.0, -1.0]])
REF = torch.tensor([[-2.0, -2.0, -2.0, -16.0]])


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("k1", [1.0, 0.0, -2.0, 10.0]),  # x
        ("k2", [0.5, 0.0, 2.0, 50.0]),  # x^2 / 2
        # exp(-x) + x - 1: e^-1 + 0 = 0.3679; 1 + 0 - 1 = 0; e^2 - 2 - 1 = 4.3891; e^-10 + 9
        ("k3", [math.exp(-1), 0.0, math.exp(2) - 3, math.exp(-10) + 9]),
        ("k3+", [math.exp(-1), 0.0, math.exp(2) - 3, math.exp(-10) + 9]),  # k3's value
    ],
)
def test_estimator_values(kind, expected):
    assert kl_estimate(LOGPROBS, REF, kind)[0].tolist() == pytest.approx(expected, rel=1e-6)


def _grad(kind):
    lp = LOGPROBS.clone().requires_grad_()
    ref = REF.clone().requires_grad_()
    kl_estimate(lp, ref, kind).sum().backward()
    return lp.grad[0], ref.grad


def test_k3_plus_has_k2_gradient():
    # k2' = x = [1, 0, -2, 0 (clamped)]; k3' = 1 - exp(-x) = [0.632, 0, -6.389, 0]
    k3p, _ = _grad("k3+")
    k2, _ = _grad("k2")
    k3, _ = _grad("k3")
    assert torch.allclose(k3p, k2) and k3p.tolist() == pytest.approx([1.0, 0.0, -2.0, 0.0])
    assert k3.tolist() == pytest.approx([1 - math.exp(-1), 0.0, 1 - math.exp(2), 0.0], rel=1e-6)
    assert not torch.allclose(k3p, k3)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_gradient_is_finite_and_zero_beyond_the_clamp(kind):
    # x = 15 is clamped to 10: no gradient there for any estimator.
    g, _ = _grad(kind)
    assert torch.isfinite(g).all() and g[3] == 0


def test_unknown_estimator():
    with pytest.raises(ValueError, match="KL estimator"):
        kl_estimate(LOGPROBS, REF, "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "k3+"])
def test_kl_estimate_with_grad_is_autograds_gradient(kind):
    # the 4th token is past the clamp at 10: value clamped, gradient 0
    from distrl.algo.kl import kl_estimate_with_grad

    logprobs = LOGPROBS.clone().requires_grad_()
    upstream = torch.tensor([[0.5, 1.0, 2.0, 1.0]])
    (kl_estimate(logprobs, REF, kind) * upstream).sum().backward()
    value, grad = kl_estimate_with_grad(LOGPROBS, REF, kind, upstream)
    assert torch.equal(value, kl_estimate(LOGPROBS, REF, kind))
    assert torch.equal(grad, logprobs.grad) and grad[0, 3] == 0
