"""SAPO's soft gate (distrl/algo/sapo.py): values and gradients by hand, a float64 gradient check, the asymmetric
temperatures, its two limits (tau -> 0: the unclipped importance-sampled gradient; tau large: a hard trust region
that narrows around r = 1), on-policy equal to PPO, and its figures through `compute_loss`."""

import math

import pytest
import torch

from distrl.algo import LossInputs, compute_loss
from distrl.algo.sapo import sapo_term
from distrl.config import LossConfig, PPOConfig, SAPOConfig
from distrl.merging import values


def _sapo(ratios, advantages, tau_pos=1.0, tau_neg=1.05):
    log_ratio = torch.tensor([[math.log(r) for r in ratios]], dtype=torch.float64, requires_grad=True)
    pg, gate = sapo_term(log_ratio, torch.tensor([advantages], dtype=torch.float64), tau_pos, tau_neg)
    pg.sum().backward()
    return pg[0].tolist(), log_ratio.grad[0].tolist(), gate[0].tolist()


def test_sapo_by_hand():
    # s = sigmoid(tau (r - 1)), f = 4 s / tau, pg = -f A, gate g = 4 s (1 - s), d pg / d log r = -A r g
    # r 1,   A 1,  tau_pos 1:    s 0.5,    f 2,      pg -2,      g 1,      grad -1
    # r 2,   A -1, tau_neg 1.05: s 0.74077, f 2.82200, pg 2.82200,  g 0.76811, grad 2 x 0.76811 = 1.53622
    # r 0.5, A 2,  tau_pos 1:    s 0.37754, f 1.51016, pg -3.02033, g 0.94001, grad -2 x 0.5 x 0.94001 = -0.94001
    # r 1.5, A 1,  tau_pos 1:    s 0.62246, f 2.48984, pg -2.48984, g 0.94001, grad -1.5 x 0.94001 = -1.41002
    pg, grad, gate = _sapo([1.0, 2.0, 0.5, 1.5], [1.0, -1.0, 2.0, 1.0])
    assert pg == pytest.approx([-2.0, 2.8219996, -3.0203254, -2.4898373])
    assert grad == pytest.approx([-1.0, 1.5362196, -0.9400148, -1.4100223])
    assert gate == pytest.approx([1.0, 0.7681098, 0.9400148, 0.9400148])


def test_the_temperature_follows_the_sign_of_the_advantage():
    # r 2 with A = +1 takes tau_pos, with A = -1 (and A = 0) tau_neg: tau_neg 4 gates far harder than tau_pos 1
    _, _, gate = _sapo([2.0, 2.0, 2.0], [1.0, -1.0, 0.0], tau_pos=1.0, tau_neg=4.0)
    # g = sech^2(tau (r - 1) / 2): tau 1 -> sech^2(0.5) = 0.78645; tau 4 -> sech^2(2) = 0.07065
    assert gate == pytest.approx([0.7864477, 0.0706508, 0.0706508])


def test_float64_gradient_check():
    g = torch.Generator().manual_seed(0)
    log_ratio = (0.8 * torch.randn(3, 5, generator=g, dtype=torch.float64)).requires_grad_()
    advantages = torch.randn(3, 5, generator=g, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: sapo_term(x, advantages, 1.0, 1.05)[0], (log_ratio,))


def test_on_policy_the_gradient_is_ppo_s_whatever_the_temperature():
    # At r = 1 every gate lets the whole gradient through: -A grad log pi, as PPO (and any loss here) on-policy
    for tau in (0.1, 1.0, 30.0):
        _, grad, gate = _sapo([1.0, 1.0], [0.7, -1.3], tau_pos=tau, tau_neg=tau)
        assert grad == pytest.approx([-0.7, 1.3]) and gate == pytest.approx([1.0, 1.0])


def test_as_tau_goes_to_zero_the_gradient_is_the_unclipped_one():
    # g = sech^2(tau (r - 1) / 2) -> 1: d pg / d log r -> -A r, PPO's without its clip, at every ratio
    ratios, advantages = [0.3, 0.9, 1.0, 1.7, 4.0], [1.0, -2.0, 0.5, 1.0, -1.0]
    _, grad, _ = _sapo(ratios, advantages, tau_pos=1e-4, tau_neg=1e-4)
    assert grad == pytest.approx([-a * r for r, a in zip(ratios, advantages, strict=True)], rel=1e-7)


def test_as_tau_grows_the_gate_becomes_a_hard_trust_region_around_one():
    # The gate is 1 at r = 1 and falls below 1/2 where |r - 1| > 2 asech(1/sqrt 2) / tau = 1.7627 / tau: the band
    # that passes the gradient narrows as 1 / tau, and outside it the gradient vanishes like 4 e^(-tau |r - 1|).
    ratios = [0.9, 0.99, 1.0, 1.01, 1.1]
    for tau, kept in ((1.0, [True] * 5), (100.0, [False, True, True, True, False]),
                      (1000.0, [False, False, True, False, False])):
        _, grad, gate = _sapo(ratios, [1.0] * 5, tau_pos=tau, tau_neg=tau)
        assert [g >= 0.5 for g in gate] == kept
    # tau 1000: at r = 1 the whole gradient -A r = -1; at |r - 1| = 0.01 sech^2(5) = 1.8e-4 of it; at 0.1
    # sech^2(50) ~ 1e-43
    _, grad, _ = _sapo(ratios, [1.0] * 5, tau_pos=1000.0, tau_neg=1000.0)
    assert grad[2] == -1.0 and max(abs(grad[1]), abs(grad[3])) < 2e-4 and max(abs(grad[0]), abs(grad[4])) < 1e-40


def test_figures_through_compute_loss():
    # ratios 1 and e^3 = 20.1 (A = 1, tau 1): gates 1 and sech^2((e^3 - 1) / 2) = 2e-8 -> gate_mean 0.5,
    # gated_frac 1/2 (the padding's ratio e^7 is not counted)
    x = LossInputs(logprobs=torch.tensor([[0.0, 3.0, 7.0]]), old_logprobs=torch.zeros(1, 3),
                   advantages=torch.tensor([[1.0, 1.0, 1.0]]), mask=torch.tensor([[1.0, 1.0, 0.0]]))
    m = values(compute_loss(x, LossConfig(policy=SAPOConfig())).metrics)
    assert m["gate_mean"] == pytest.approx(0.5, abs=1e-6) and m["gated_frac"] == pytest.approx(0.5)
    assert "clip_frac" not in m and m["ppo_kl"] == pytest.approx(-1.5)
    # seq_mean_token_mean, the default: pg = -f = [-2, -4 sigmoid(e^3 - 1) ~ -4] -> mean -3.0
    assert m["loss/policy"] == pytest.approx(-(2.0 + 4.0 / (1.0 + math.exp(-(math.exp(3.0) - 1.0)))) / 2)


def test_compute_loss_gradient_against_ppo_on_policy():
    # Through compute_loss too: on-policy SAPO's and PPO's gradients are the same (seq_mean_token_mean both)
    g = torch.Generator().manual_seed(3)
    logprobs = -torch.rand(4, 6, generator=g)
    mask = (torch.arange(6) < torch.tensor([[6], [3], [5], [1]])).float()
    advantages = torch.randn(4, 1, generator=g).expand(4, 6)
    grads = []
    for policy in (SAPOConfig(), PPOConfig(aggregation="seq_mean_token_mean")):
        lp = logprobs.clone().requires_grad_()
        compute_loss(LossInputs(logprobs=lp, old_logprobs=logprobs, advantages=advantages, mask=mask),
                     LossConfig(policy=policy)).loss.backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1])
