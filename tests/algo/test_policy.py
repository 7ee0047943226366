"""PPO / GSPO per-token terms: every clipping branch worked by hand, and GSPO against its sequence-level form."""

import math
from types import SimpleNamespace

import pytest
import torch

from distrl.algo import LossInputs, aggregate, clipped_surrogate, gspo_log_ratio, policy_term, ppo_log_ratio

from .helpers import ragged_mask


def _term(logprobs, old, advantages, mask, policy, clip_low, clip_high):
    """PPO's or GSPO's clipped term: (pg, clipped, dual_clipped)."""
    log_ratio = ppo_log_ratio(logprobs, old) if policy == "ppo" else gspo_log_ratio(logprobs, old, mask)
    return clipped_surrogate(log_ratio, advantages, clip_low, clip_high, None)


def _pg(ratio, advantage, clip_low=0.2, clip_high=0.2, dual_clip=None):
    """pg, d pg / d log_ratio, clipped, dual_clipped for one token with the given ratio."""
    log_ratio = torch.tensor([[math.log(ratio)]], requires_grad=True)
    pg, clipped, dual = clipped_surrogate(log_ratio, torch.tensor([[advantage]]), clip_low, clip_high, dual_clip)
    pg.sum().backward()
    return pg.item(), log_ratio.grad.item(), clipped.item(), dual.item()


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_pg", "expected_grad", "expected_clipped"),
    [
        # inside [0.8, 1.2]: pg = -A r = -1.1, d/dlog r = -A r = -1.1
        (1.1, 1.0, -1.1, -1.1, False),
        # above 1 + clip_high with A > 0: max(-1.5, -1.2) = -1.2, clipped, no gradient
        (1.5, 1.0, -1.2, 0.0, True),
        # below 1 - clip_low with A < 0: max(0.5, 0.8) = 0.8, clipped, no gradient
        (0.5, -1.0, 0.8, 0.0, True),
        # below 1 - clip_low with A > 0: max(-0.5, -0.8) = -0.5, NOT clipped (pessimistic bound), gradient -0.5
        (0.5, 1.0, -0.5, -0.5, False),
        # above 1 + clip_high with A < 0: max(1.5, 1.2) = 1.5, NOT clipped, gradient -A r = 1.5
        (1.5, -1.0, 1.5, 1.5, False),
        # A = 2, r = 1.5: max(-3, -2.4) = -2.4, clipped
        (1.5, 2.0, -2.4, 0.0, True),
    ],
)
def test_ppo_clip_branches(ratio, advantage, expected_pg, expected_grad, expected_clipped):
    pg, grad, clipped, dual = _pg(ratio, advantage)
    assert pg == pytest.approx(expected_pg) and grad == pytest.approx(expected_grad, abs=1e-7)
    assert clipped == expected_clipped and not dual


def test_clip_higher_is_asymmetric():
    # clip_high 0.28: r = 1.25 < 1.28 stays unclipped, pg = -1.25; with symmetric 0.2 it clips to -1.2
    assert _pg(1.25, 1.0, clip_low=0.2, clip_high=0.28)[:3] == pytest.approx((-1.25, -1.25, False))
    assert _pg(1.25, 1.0)[:3] == pytest.approx((-1.2, 0.0, True))
    # the low side still clips at 0.8: A = -1, r = 0.7 -> max(0.7, 0.8) = 0.8
    assert _pg(0.7, -1.0, clip_low=0.2, clip_high=0.28)[0] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("ratio", "advantage", "expected_pg", "expected_grad", "expected_dual"),
    [
        # A = -1, r = 5: PPO gives max(5, 1.2) = 5; dual clip c = 3 caps it at -c A = 3, no gradient
        (5.0, -1.0, 3.0, 0.0, True),
        # A = -1, r = 2: PPO gives 2 < 3, the cap does not bind; gradient -A r = 2
        (2.0, -1.0, 2.0, 2.0, False),
        # A = +1, r = 5: PPO gives -1.2; the cap is for A < 0 only (min(-1.2, -3) would be wrong)
        (5.0, 1.0, -1.2, 0.0, False),
        # A = -0.5, r = 10: max(5, 0.6) = 5 > -c A = 1.5 -> 1.5
        (10.0, -0.5, 1.5, 0.0, True),
    ],
)
def test_dual_clip(ratio, advantage, expected_pg, expected_grad, expected_dual):
    pg, grad, _, dual = _pg(ratio, advantage, dual_clip=3.0)
    assert pg == pytest.approx(expected_pg) and grad == pytest.approx(expected_grad, abs=1e-7)
    assert dual == expected_dual


def test_log_ratio_is_clamped_at_20():
    # log r = 50 would overflow float32 after multiplication; clamped: r = e^20, pg = -A e^20 (A < 0: +e^20)
    pg, _, _ = clipped_surrogate(torch.tensor([[50.0, -50.0]]), torch.tensor([[-1.0, 1.0]]), 0.2, 0.2, None)
    assert pg[0, 0].item() == pytest.approx(math.exp(20)) and torch.isfinite(pg).all()
    # log r = -50, A = 1: max(-e^-20, -0.8) = -e^-20
    assert pg[0, 1].item() == pytest.approx(-math.exp(-20))


def test_gspo_ratio_is_the_geometric_mean_on_every_token():
    # sequence 0: log ratios [0.2, -0.1] (third token padding, log ratio 5 must be ignored) -> mean 0.05
    # sequence 1: log ratios [0.4, 0.4, 0.4] -> mean 0.4 -> s = e^0.4 = 1.4918 > 1.2 -> clipped at -1.2 (A = 1)
    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[0.2, -0.1, 5.0], [0.4, 0.4, 0.4]])
    mask = ragged_mask([2, 3], 3)
    log_s = gspo_log_ratio(logprobs, old, mask)
    assert log_s[0, :2].tolist() == pytest.approx([0.05, 0.05]) and log_s[1].tolist() == pytest.approx([0.4] * 3)
    pg, clipped, _ = _term(logprobs, old, torch.ones(2, 3), mask, "gspo", 0.2, 0.2)
    assert pg[0, :2].tolist() == pytest.approx([-math.exp(0.05)] * 2)  # -1.0513 on both tokens
    assert pg[1].tolist() == pytest.approx([-1.2] * 3) and clipped[1].all() and not clipped[0, :2].any()


def test_gspo_gradient_equals_sequence_level_objective():
    # Sequence-level GSPO objective (arXiv 2507.18071): s_i = exp(mean_t (log pi - log pi_old)),
    # J = mean_i max(-A_i s_i, -A_i clip(s_i, 1 - eps, 1 + eps)), differentiated straight through s_i.
    torch.manual_seed(0)
    lengths = [5, 3, 6, 1, 4, 6]
    mask = ragged_mask(lengths, 6)
    old = -torch.rand(6, 6) * 2
    logprobs = (old + 0.4 * torch.randn(6, 6)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.3, 1.5])
    pg, _, _ = _term(logprobs, old, adv[:, None].expand(6, 6), mask, "gspo", 0.2, 0.25)
    token_loss = aggregate(pg, mask, "seq_mean_token_mean")
    (grad_token,) = torch.autograd.grad(token_loss, logprobs)

    seq_logprobs = logprobs.detach().clone().requires_grad_()
    s = torch.exp(((seq_logprobs - old) * mask).sum(-1) / mask.sum(-1))
    seq_loss = torch.maximum(-adv * s, -adv * s.clamp(0.8, 1.25)).mean()
    (grad_seq,) = torch.autograd.grad(seq_loss, seq_logprobs)

    assert token_loss.item() == pytest.approx(seq_loss.item(), rel=1e-6)
    torch.testing.assert_close(grad_token, grad_seq, rtol=1e-5, atol=1e-7)
    # the batch is set up so that both clipped (zero-gradient) and unclipped sequences occur
    clipped_rows = (grad_seq.abs().sum(-1) == 0)
    assert clipped_rows.any() and not clipped_rows.all()


def test_gspo_differs_from_ppo():
    # A check that the GSPO path is really taken: same inputs, different per-token terms.
    old = torch.zeros(1, 2)
    logprobs = torch.tensor([[0.3, -0.3]])
    ppo, _, _ = _term(logprobs, old, torch.ones(1, 2), torch.ones(1, 2), "ppo", 0.2, 0.2)
    gspo, _, _ = _term(logprobs, old, torch.ones(1, 2), torch.ones(1, 2), "gspo", 0.2, 0.2)
    # PPO: r = [e^0.3 = 1.35 -> 1.2, e^-0.3 = 0.741] -> [-1.2, -0.741]; GSPO: s = e^0 = 1 on both -> [-1, -1]
    assert ppo[0].tolist() == pytest.approx([-1.2, -math.exp(-0.3)]) and gspo[0].tolist() == pytest.approx([-1, -1])


def test_unknown_policy():
    x = LossInputs(logprobs=torch.zeros(1, 1), old_logprobs=torch.zeros(1, 1), advantages=torch.zeros(1, 1),
                   mask=torch.ones(1, 1))
    with pytest.raises(ValueError, match="policy loss 'a2c'; expected one of ppo, gspo, cispo"):
        policy_term(x, SimpleNamespace(type="a2c"))


@pytest.mark.parametrize(
    ("log_ratio", "advantage", "dual_clip", "pg", "grad", "clipped", "dual"),
    [
        (0.5, 1.0, None, -1.2, 0.0, 1.0, None),  # r = e^0.5 = 1.65 > 1.2, A > 0: clipped branch, no gradient
        (0.0, 2.0, None, -2.0, -2.0, 0.0, None),  # r = 1: -A r, gradient -A r = -2
        (-1.0, -1.0, None, 0.8, 0.0, 1.0, None),  # r = e^-1 = 0.37 < 0.8, A < 0: clipped at -A 0.8
        (2.0, -1.0, 3.0, 3.0, 0.0, 0.0, 1.0),  # r = e^2 = 7.39, A < 0: -A r = 7.39 capped at -c A = 3
        (1.0, 1.0, 3.0, -1.2, 0.0, 1.0, 0.0),  # A > 0 is never capped
        (25.0, -1.0, None, math.exp(20.0), 0.0, 0.0, None),  # log-ratio clamped at 20: value e^20, no gradient
    ],
)
def test_clipped_surrogate_with_grad_by_hand(log_ratio, advantage, dual_clip, pg, grad, clipped, dual):
    from distrl.algo.policy import clipped_surrogate_with_grad

    out = clipped_surrogate_with_grad(torch.tensor([[log_ratio]]), torch.tensor([[advantage]]), torch.tensor(1.0),
                                      0.2, 0.2, dual_clip)
    assert out[0].item() == pytest.approx(pg, rel=1e-6) and out[1].item() == pytest.approx(grad)
    assert out[2].item() == clipped and (out[3] is None if dual is None else out[3].item() == dual)
    # the same values and gradient as autograd through clipped_surrogate
    if log_ratio != 25.0:
        assert (out[0].item(), out[1].item()) == pytest.approx(_pg(math.exp(log_ratio), advantage,
                                                                   dual_clip=dual_clip)[:2], rel=1e-6)
