"""GPG and CISPO (distrl/algo/reinforce.py): values and gradients by hand, CISPO's gradient equal to
-sg(clip(r)) A grad log pi (no token's gradient dropped, where PPO's clip drops it), float64 gradient checks, and
both through `compute_loss`."""

import math

import pytest
import torch

from distrl.algo import LossInputs, compute_loss
from distrl.algo.reinforce import cispo_term, cispo_weight, gpg_term, reinforce_term
from distrl.config import CISPOConfig, GPGConfig, LossConfig, PPOConfig
from distrl.merging import values

from .helpers import random_inputs

# Three tokens: ratios 1.5, 1, 0.5; advantages 1, -2, 1; log pi -1, -0.5, -2.
LOGPROBS = [-1.0, -0.5, -2.0]
OLD = [-1.0 - math.log(1.5), -0.5, -2.0 - math.log(0.5)]
ADV = [1.0, -2.0, 1.0]


def _cispo(clip_low, clip_high):
    logprobs = torch.tensor([LOGPROBS], dtype=torch.float64, requires_grad=True)
    pg, clipped = cispo_term(logprobs, torch.tensor([OLD], dtype=torch.float64), torch.tensor([ADV],
                             dtype=torch.float64), clip_low, clip_high)
    pg.sum().backward()
    return pg[0].tolist(), logprobs.grad[0].tolist(), clipped[0].tolist()


def test_cispo_by_hand_without_a_lower_bound():
    # weights clip(r, -inf, 1.2) = [1.2, 1, 0.5]; pg = -w A log pi = [-(1.2)(1)(-1), -(1)(-2)(-0.5), -(0.5)(1)(-2)]
    #                                                               = [1.2, -1.0, 1.0]
    # gradient -w A = [-1.2, 2.0, -0.5]: the first token's ratio is clipped, and its gradient is still there
    pg, grad, clipped = _cispo(None, 0.2)
    assert pg == pytest.approx([1.2, -1.0, 1.0]) and grad == pytest.approx([-1.2, 2.0, -0.5])
    assert clipped == [True, False, False]


def test_cispo_by_hand_with_a_lower_bound():
    # clip_low 0.2: the third weight 0.5 -> 0.8: pg -(0.8)(1)(-2) = 1.6, gradient -0.8
    pg, grad, clipped = _cispo(0.2, 0.2)
    assert pg == pytest.approx([1.2, -1.0, 1.6]) and grad == pytest.approx([-1.2, 2.0, -0.8])
    assert clipped == [True, False, True]


def test_cispo_keeps_the_gradient_ppo_drops():
    # The first token (r = 1.5 > 1.2, A = 1) is clipped by PPO: its gradient is 0 there, -1.2 under CISPO.
    inputs = [LossInputs(logprobs=torch.tensor([LOGPROBS], requires_grad=True), old_logprobs=torch.tensor([OLD]),
                         advantages=torch.tensor([ADV]), mask=torch.ones(1, 3)) for _ in range(2)]
    compute_loss(inputs[0], LossConfig(policy=PPOConfig())).loss.backward()
    compute_loss(inputs[1], LossConfig(policy=CISPOConfig(clip_high=0.2))).loss.backward()
    assert inputs[0].logprobs.grad[0, 0] == 0 and inputs[1].logprobs.grad[0, 0] == pytest.approx(-1.2 / 3)


@pytest.mark.parametrize("clip_low", [None, 0.3])
def test_cispo_gradient_is_the_clipped_weight_times_the_advantage(clip_low):
    # The defining equality: grad pg_t = -sg(clip(r_t)) A_t grad log pi_t, on every token, whatever the ratio.
    x = random_inputs([5, 3, 6], 6, seed=1, spread=1.0)
    pg, _ = cispo_term(x.logprobs, x.old_logprobs, x.advantages, clip_low, 0.25)
    (grad,) = torch.autograd.grad((pg * x.mask).sum(), x.logprobs)
    ratio = torch.exp(x.logprobs.detach() - x.old_logprobs)
    weight = ratio.clamp(None if clip_low is None else 1 - clip_low, 1.25)
    torch.testing.assert_close(grad, -weight * x.advantages * x.mask)
    assert ((weight != ratio) & (x.mask > 0)).any()  # some weights really are clipped here
    assert (grad[x.mask > 0] != 0).all()  # and no token's gradient is dropped


def test_cispo_weight_is_a_constant_and_its_clamp_follows_exp_ratio():
    # log r = 30 is clamped at 20 before exp (e^20 then clipped at 1 + 3 = 4); log r = -30 gives e^-20, no lower bound
    weight, clipped = cispo_weight(torch.tensor([[30.0, -30.0]], requires_grad=True), None, 3.0)
    assert not weight.requires_grad and weight[0].tolist() == pytest.approx([4.0, math.exp(-20.0)])
    assert clipped[0].tolist() == [True, False]


def test_gpg_is_minus_advantage_times_log_pi_with_float64_gradcheck():
    # pg = -A log pi = [-(1)(-1), -(-2)(-0.5), -(1)(-2)] = [1, -1, 2]; gradient -A = [-1, 2, -1]
    logprobs = torch.tensor([LOGPROBS], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([ADV], dtype=torch.float64)
    assert gpg_term(logprobs, advantages)[0].tolist() == pytest.approx([1.0, -1.0, 2.0])
    assert torch.autograd.gradcheck(lambda lp: gpg_term(lp, advantages), (logprobs,))
    # CISPO's term with its weight held fixed is the same function of log pi: its gradient checks too
    coef = torch.tensor([[1.2, -2.0, 0.5]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda lp: reinforce_term(lp, coef), (logprobs,))


def test_cispo_at_ratio_one_is_gpg():
    # On-policy (log pi = log pi_old) every weight is 1, so CISPO's loss and gradient are GPG's
    x = random_inputs([4, 2, 5], 5, seed=2)
    on_policy = [LossInputs(logprobs=x.logprobs.detach().clone().requires_grad_(), old_logprobs=x.logprobs.detach(),
                            advantages=x.advantages, mask=x.mask) for _ in range(2)]
    a = compute_loss(on_policy[0], LossConfig(policy=CISPOConfig(clip_low=0.1, clip_high=0.1)))
    b = compute_loss(on_policy[1], LossConfig(policy=GPGConfig()))
    a.loss.backward()
    b.loss.backward()
    assert a.loss.item() == pytest.approx(b.loss.item(), rel=1e-6)
    torch.testing.assert_close(on_policy[0].logprobs.grad, on_policy[1].logprobs.grad)
    assert values(a.metrics)["clip_frac"] == 0.0 and "clip_frac" not in b.metrics


def test_cispo_and_gpg_metrics_through_compute_loss():
    # CISPO with clip_high 0.2 on the three tokens: 1 of 3 weights clipped; ppo_kl = mean(old - new)
    #   = -(ln 1.5 + 0 + ln 0.5) / 3 = 0.0959
    x = LossInputs(logprobs=torch.tensor([LOGPROBS]), old_logprobs=torch.tensor([OLD]), advantages=torch.tensor([ADV]),
                   mask=torch.ones(1, 3))
    m = values(compute_loss(x, LossConfig(policy=CISPOConfig(clip_high=0.2))).metrics)
    assert m["clip_frac"] == pytest.approx(1 / 3) and m["ppo_kl"] == pytest.approx(-math.log(0.75) / 3)
    # token_mean of pg [1.2, -1.0, 1.0]: 0.4
    assert m["loss/policy"] == pytest.approx(0.4)
