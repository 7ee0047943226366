"""GMPO (distrl/algo/gmpo.py): the clipped geometric mean by hand, the token form's value and gradient equal to the
sequence-level objective (and a float64 gradient check of it), GMPO equal to GSPO's sequence ratio where no token is
clipped, and its figures through `compute_loss`."""

import math

import pytest
import torch

from distrl.algo import LossInputs, aggregate, compute_loss
from distrl.algo.gmpo import gmpo_clipped_log_ratio, gmpo_term
from distrl.config import GMPOConfig, GSPOConfig, LossConfig
from distrl.merging import values

from .helpers import ragged_mask


def _hand():
    # sequence 0, A = +1: log-ratios [0.5, 0.1] -> clipped above at 0.4: [0.4, 0.1]; log rho = 0.25
    # sequence 1, A = -1: log-ratios [0.5, -0.6] -> clipped below at -0.4: [0.5, -0.4]; log rho = 0.05
    # (its third token is padding, whose log-ratio 9 must not count)
    logprobs = torch.tensor([[0.5, 0.1, 0.0], [0.5, -0.6, 9.0]], dtype=torch.float64, requires_grad=True)
    advantages = torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = ragged_mask([2, 2], 3).double()
    return logprobs, torch.zeros(2, 3, dtype=torch.float64), advantages * mask, mask


def test_gmpo_by_hand():
    logprobs, old, advantages, mask = _hand()
    pg, rho, clipped = gmpo_term(logprobs * mask, old, advantages, mask, 0.4, 0.4)
    # rho = [e^0.25, e^0.05] = [1.28403, 1.05127]; pg = -A rho on every token of the sequence
    assert rho.tolist() == pytest.approx([math.exp(0.25), math.exp(0.05)])
    assert pg[0, :2].tolist() == pytest.approx([-math.exp(0.25)] * 2)
    assert pg[1, :2].tolist() == pytest.approx([math.exp(0.05)] * 2)
    assert clipped.tolist() == [[True, False, False], [False, True, False]]
    # seq_mean_token_mean: (-1.28403 + 1.05127) / 2 = -0.11638; its gradient: -A_i rho_i / |o_i| / 2 sequences on
    # the unclipped tokens: [0, -1.28403 / 4 = -0.32101] and [1.05127 / 4 = 0.26282, 0]
    loss = aggregate(pg, mask, "seq_mean_token_mean")
    loss.backward()
    assert loss.item() == pytest.approx((math.exp(0.05) - math.exp(0.25)) / 2)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[0.0, -math.exp(0.25) / 4, 0.0],
                                                            [math.exp(0.05) / 4, 0.0, 0.0]], dtype=torch.float64))


def test_the_clip_is_one_sided_like_ppo_s():
    # A > 0 clips only above (a low ratio is not raised), A < 0 only below, A = 0 contributes 0 to the mean
    x = torch.tensor([[0.9, -0.9, 0.9, -0.9, 0.9]])
    a = torch.tensor([[1.0, 1.0, -1.0, -1.0, 0.0]])
    assert gmpo_clipped_log_ratio(x, a, 0.4, 0.4)[0].tolist() == pytest.approx([0.4, -0.9, 0.9, -0.4, 0.0])


def _sequence_objective(logprobs, old, adv, mask, clip_low, clip_high):
    """The paper's objective as written, per sequence: mean_i -A_i exp(mean_t x~_it), no stop-gradients."""
    x = (logprobs - old) * mask
    clipped = torch.where(adv[:, None] > 0, x.clamp(max=clip_high), x.clamp(min=-clip_low))
    return (-adv * torch.exp((clipped * mask).sum(-1) / mask.sum(-1))).mean()


def test_the_token_form_has_the_sequence_objective_s_value_and_gradient_and_checks_in_float64():
    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 6, 1, 4, 6]
    mask = ragged_mask(lengths, 6).double()
    old = -torch.rand(6, 6, generator=g, dtype=torch.float64) * 2 * mask
    logprobs = ((old + 0.4 * torch.randn(6, 6, generator=g, dtype=torch.float64)) * mask).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 1.5], dtype=torch.float64)

    def token_form(lp):
        pg, _, _ = gmpo_term(lp * mask, old, adv[:, None].expand(6, 6) * mask, mask, 0.3, 0.35)
        return aggregate(pg, mask, "seq_mean_token_mean")

    loss = token_form(logprobs)
    (grad,) = torch.autograd.grad(loss, logprobs)
    sequence = _sequence_objective(logprobs, old, adv, mask, 0.3, 0.35)
    (grad_sequence,) = torch.autograd.grad(sequence, logprobs)
    assert loss.item() == pytest.approx(sequence.item(), rel=1e-12)
    torch.testing.assert_close(grad, grad_sequence)
    # the batch has clipped tokens (zero gradient) and unclipped ones
    assert (grad[mask > 0] == 0).any() and (grad[mask > 0] != 0).any()
    # finite differences of the aggregated loss agree with the token form's stop-gradient construction
    assert torch.autograd.gradcheck(token_form, (logprobs,))


def _gmpo_and_wide_gspo(spread):
    """Figures and gradients of GMPO (its paper's clip 0.4) and of GSPO with a clip range that never binds."""
    g = torch.Generator().manual_seed(1)
    mask = ragged_mask([5, 2, 6, 0, 3], 6)
    old = -torch.rand(5, 6, generator=g) * 2
    logprobs = old + spread * (torch.rand(5, 6, generator=g) * 2 - 1)
    advantages = torch.randn(5, 1, generator=g).expand(5, 6)
    outs = []
    for policy in (GMPOConfig(), GSPOConfig(clip_low=0.999, clip_high=1e6)):
        lp = logprobs.clone().requires_grad_()
        out = compute_loss(LossInputs(logprobs=lp, old_logprobs=old, advantages=advantages, mask=mask),
                           LossConfig(policy=policy))
        out.loss.backward()
        outs.append((values(out.metrics), lp.grad))
    return outs


def test_without_clipped_tokens_gmpo_is_gspo_s_sequence_ratio():
    # Every |log r| < 0.3 < 0.4: no token is clipped, so rho_i = exp(mean_t log r_t) = GSPO's s_i, and GMPO's loss
    # and gradient are those of GSPO with a clip range that never binds.
    (gmpo, gmpo_grad), (gspo, gspo_grad) = _gmpo_and_wide_gspo(0.3)
    assert gmpo["loss/policy"] == pytest.approx(gspo["loss/policy"], rel=1e-6) and gmpo["clip_frac"] == 0.0
    for key in ("seq_ratio_mean", "seq_ratio_min", "seq_ratio_max"):
        assert gmpo[key] == pytest.approx(gspo[key], rel=1e-6)
    torch.testing.assert_close(gmpo_grad, gspo_grad)
    # the control: log-ratios up to 0.9, some clipped, and GMPO's ratio is no longer GSPO's
    (gmpo, gmpo_grad), (gspo, gspo_grad) = _gmpo_and_wide_gspo(0.9)
    assert gmpo["clip_frac"] > 0 and gmpo["seq_ratio_max"] != pytest.approx(gspo["seq_ratio_max"], rel=1e-3)
    assert not torch.allclose(gmpo_grad, gspo_grad)


def test_a_sequence_ratio_past_the_clamp_has_no_gradient():
    # A < 0 leaves the upper side unclipped: log-ratios of 30 average to 30 > 20, clamped, so rho = e^20 and the
    # gradient is 0 (as PPO's past its clamp); the second sequence (0.1) is untouched
    logprobs = torch.tensor([[30.0, 30.0], [0.1, 0.1]], requires_grad=True)
    out = compute_loss(LossInputs(logprobs=logprobs, old_logprobs=torch.zeros(2, 2),
                                  advantages=torch.tensor([[-1.0, -1.0], [1.0, 1.0]]), mask=torch.ones(2, 2)),
                       LossConfig(policy=GMPOConfig()))
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and values(out.metrics)["seq_ratio_max"] == pytest.approx(math.exp(20))
    assert logprobs.grad[0].tolist() == [0.0, 0.0]
    assert logprobs.grad[1].tolist() == pytest.approx([-math.exp(0.1) / 4] * 2)


def test_figures_through_compute_loss():
    logprobs, old, advantages, mask = _hand()
    m = values(compute_loss(LossInputs(logprobs=logprobs.detach().float(), old_logprobs=old.float(),
                                       advantages=advantages.float(), mask=mask.float()),
                            LossConfig(policy=GMPOConfig())).metrics)
    # 2 of the 4 valid tokens clipped; seq_ratio weighted by tokens (2 each): mean (1.28403 + 1.05127) / 2
    assert m["clip_frac"] == pytest.approx(0.5)
    assert m["seq_ratio_mean"] == pytest.approx((math.exp(0.25) + math.exp(0.05)) / 2)
    assert (m["seq_ratio_min"], m["seq_ratio_max"]) == pytest.approx((math.exp(0.05), math.exp(0.25)))
