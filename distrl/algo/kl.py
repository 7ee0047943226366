"""Per-token estimators of KL(pi || pi_ref) from the log-probs of sampled tokens.

Source: J. Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html. With samples from
pi and x = log pi - log pi_ref: k1 = x (unbiased, high variance), k2 = x^2 / 2 (biased, low variance),
k3 = (pi_ref / pi - 1) - log(pi_ref / pi) = exp(-x) - 1 + x (unbiased, low variance, >= 0).
"""

from __future__ import annotations

from typing import Literal

import torch

KLEstimator = Literal["k1", "k2", "k3", "k3+"]

# Beyond |x| = 10 the estimate is dominated by a few outlier tokens (exp(10) ~ 2e4); clamping keeps k3 finite.
_CLAMP = 10.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator) -> torch.Tensor:
    """Per-token KL estimate `[B, T]` from `logprobs` `[B, T]` (gradient flows) and `ref_logprobs` `[B, T]`.

    `k3+` has k3's value and k2's gradient (straight-through). Why: with samples from pi, k2's gradient
    x * grad(log pi) is in expectation exactly grad KL(pi || pi_ref), while k3's gradient (1 - exp(-x)) grad(log pi)
    is in expectation the gradient of the *other* direction, KL(pi_ref || pi). So k3+ logs the low-variance k3
    value but optimises the intended divergence.
    """
    x = torch.clamp(logprobs - ref_logprobs, -_CLAMP, _CLAMP)
    if kind == "k1":
        return x
    k2 = 0.5 * x * x
    if kind == "k2":
        return k2
    k3 = torch.exp(-x) + x - 1.0
    if kind == "k3":
        return k3
    if kind == "k3+":
        return k2 + (k3 - k2).detach()
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2, k3 or k3+")


def kl_estimate_with_grad(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator,
                          upstream: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`kl_estimate` (bit for bit) and d loss / d logprobs `[B, T]` given `upstream` = d loss / d kl (None: no
    gradient), computed as autograd computes it through `kl_estimate`, without booleans or torch.where:

        k1: g    k2, k3+: g x    k3: g - g exp(-x)    (0 where the clamp at +-10 binds)
    """
    diff = logprobs - ref_logprobs
    x = torch.clamp(diff, -_CLAMP, _CLAMP)
    if kind == "k1":
        value, grad = x, None if upstream is None else upstream.expand_as(x)
    elif kind in ("k2", "k3", "k3+"):
        k2 = 0.5 * x * x
        value, grad = k2, None if upstream is None else upstream * x
        if kind != "k2":
            exp_neg = torch.exp(-x)
            k3 = exp_neg + x - 1.0
            value = k3 if kind == "k3" else k2 + (k3 - k2)
            if kind == "k3" and upstream is not None:
                grad = upstream - upstream * exp_neg
    else:
        raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2, k3 or k3+")
    if grad is not None:
        grad = torch.addcmul(grad, grad, torch.sign((x - diff).abs()), value=-1.0)
    return value, grad
