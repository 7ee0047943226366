"""Clip-Cov and KL-Cov (distrl/algo/covariance.py): the covariance and both selections by hand, the losses by hand,
Clip-Cov with a zero ratio equal to PPO, float64 gradient checks, and the selection made once on the whole batch:
its micro-batches and two learners' shards, given their slices of it, sum to the whole batch's loss and gradient,
where selecting within each micro-batch (verl's way) would not."""

import math

import pytest
import torch

from distrl.algo import LossInputs, aggregate, compute_loss, covariance_selection, token_covariance
from distrl.algo.covariance import clip_cov_selection, kl_cov_selection, kl_cov_term, selection_size
from distrl.config import ClipCovConfig, KLCovConfig, LossConfig, PPOConfig, RatioCorrection
from distrl.merging import values

from .helpers import random_inputs, rows


def test_covariance_by_hand():
    # valid old log-probs -1, -3, -2 (mean -2) and advantages 1, 1, -1 (mean 1/3); the fourth token is padding
    # cov = (old + 2)(A - 1/3) = [(1)(2/3), (-1)(2/3), (0)(-4/3)] = [0.667, -0.667, 0], and 0 on padding
    cov = token_covariance(torch.tensor([[-1.0, -3.0], [-2.0, 7.0]]), torch.tensor([[1.0, 1.0], [-1.0, 5.0]]),
                           torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    torch.testing.assert_close(cov, torch.tensor([[2 / 3, -2 / 3], [0.0, 0.0]]))


@pytest.mark.parametrize(("fraction", "tokens", "size"), [
    (2e-4, 1000, 1),    # 0.2 tokens: at least one, as verl's max(int(r N), 1)
    (2e-3, 1000, 2),    # floor(2.0)
    (0.25, 10, 2),      # floor(2.5)
    (0.0, 1000, 0),     # a zero ratio selects nothing
    (0.5, 0, 0),        # nor does an empty batch
])
def test_selection_size(fraction, tokens, size):
    assert selection_size(fraction, tokens) == size


COV = torch.tensor([[3.0, 0.5, 6.0], [1.5, 2.5, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 5 valid tokens; 9.0 sits in the padding


def test_kl_cov_selects_the_largest_covariances_of_the_valid_tokens():
    # fraction 0.4 of 5 tokens: the 2 largest valid covariances, 6.0 and 3.0 (not the padding's 9.0)
    assert kl_cov_selection(COV, MASK, 0.4).tolist() == [[True, False, True], [False, False, False]]
    # 0.2 -> 1 token: 6.0; 1.0 -> all five
    assert kl_cov_selection(COV, MASK, 0.2).tolist() == [[False, False, True], [False, False, False]]
    assert kl_cov_selection(COV, MASK, 1.0).tolist() == [[True, True, True], [True, True, False]]


def test_clip_cov_draws_its_tokens_among_the_band_only():
    # band (1, 5): candidates 3.0, 1.5, 2.5 (0.5 below, 6.0 above, 9.0 padding); fraction 0.4 of 5 -> 2 of them
    band = torch.tensor([[True, False, False], [True, True, False]])
    draws = set()
    for seed in range(30):
        picked = clip_cov_selection(COV, MASK, 0.4, 1.0, 5.0, torch.Generator().manual_seed(seed))
        assert picked.sum() == 2 and not (picked & ~band).any()
        draws.add(tuple(picked.flatten().tolist()))
    assert len(draws) == 3  # every pair of the 3 candidates is drawn: the choice is random
    same = [clip_cov_selection(COV, MASK, 0.4, 1.0, 5.0, torch.Generator().manual_seed(7)) for _ in range(2)]
    assert torch.equal(*same)  # and reproducible from its generator
    # more to select than candidates: all 3
    assert clip_cov_selection(COV, MASK, 1.0, 1.0, 5.0, torch.Generator()).sum() == 3


def _inputs(selected, **kw):
    # log-ratios 0.5 (r 1.65, A = 1: PPO clips it), 0.1, -0.2, 0.3; advantages 1, 1, -1, 2
    return LossInputs(logprobs=torch.tensor([[0.5, 0.1, -0.2, 0.3]], requires_grad=True),
                      old_logprobs=torch.zeros(1, 4), advantages=torch.tensor([[1.0, 1.0, -1.0, 2.0]]),
                      mask=torch.ones(1, 4), cov_selected=torch.tensor([selected]), **kw)


def test_clip_cov_by_hand():
    # PPO (clip 0.2): r = [1.649, 1.105, 0.819, 1.350], A = [1, 1, -1, 2]: the first and the fourth clip above 1.2
    #   pg = [-1.2, -e^0.1 = -1.10517, e^-0.2 = 0.81873, -2 x 1.2 = -2.4], clip_frac 2/4
    # Clip-Cov cuts the second and fourth tokens: pg = [-1.2, 0, 0.81873, 0] -> token mean -0.09532
    x = _inputs([False, True, False, True])
    out = compute_loss(x, LossConfig(policy=ClipCovConfig()))
    out.loss.backward()
    assert out.loss.item() == pytest.approx((-1.2 + math.exp(-0.2)) / 4)
    # gradient -A r / 4 where PPO lets it through and the token is not cut: only the third, e^-0.2 / 4 (the fourth,
    # cut and clipped both, had none to cut)
    assert x.logprobs.grad[0].tolist() == pytest.approx([0.0, 0.0, math.exp(-0.2) / 4, 0.0])
    m = values(out.metrics)
    assert m["cov_frac"] == pytest.approx(0.5) and m["clip_frac"] == pytest.approx(0.5)


def test_clip_cov_with_a_zero_ratio_is_ppo():
    # clip_cov_ratio 0 selects no token: the loss, every gradient and every figure are PPO's (cov_frac 0 aside)
    x = random_inputs([7, 2, 5, 0, 8], 8, seed=5, spread=1.0)
    no_selection = covariance_selection(x.old_logprobs, x.advantages, x.mask, ClipCovConfig(clip_cov_ratio=0.0),
                                        torch.Generator())
    assert not no_selection.any()
    outs, grads = [], []
    extra = {"correction": RatioCorrection(), "entropy_coef": 0.01}
    for policy in (ClipCovConfig(clip_cov_ratio=0.0, dual_clip=3.0, aggregation="seq_mean_token_sum"),
                   PPOConfig(dual_clip=3.0, aggregation="seq_mean_token_sum")):
        lp = x.logprobs.detach().clone().requires_grad_()
        inputs = LossInputs(**{**x.__dict__, "logprobs": lp, "entropy": x.entropy.detach(),
                               "cov_selected": no_selection})
        out = compute_loss(inputs, LossConfig(policy=policy, **extra))
        out.loss.backward()
        outs.append(values(out.metrics))
        grads.append(lp.grad)
    clip_cov, ppo = outs
    assert clip_cov.pop("cov_frac") == 0.0 and clip_cov == ppo
    assert torch.equal(grads[0], grads[1])


def test_kl_cov_by_hand():
    # -A r everywhere (no clip) + 0.5 |log r| on the first and third tokens:
    # [-e^0.5 + 0.25, -e^0.1, e^-0.2 + 0.1, -2 e^0.3]
    x = _inputs([True, False, True, False])
    pg = kl_cov_term(x.logprobs - x.old_logprobs, x.advantages, x.cov_selected.float(), 0.5)
    assert pg[0].tolist() == pytest.approx([-math.exp(0.5) + 0.25, -math.exp(0.1), math.exp(-0.2) + 0.1,
                                            -2 * math.exp(0.3)])
    # gradient: -A r + 0.5 sign(log r) on the selected ones: [-e^0.5 + 0.5, -e^0.1, e^-0.2 - 0.5, -2 e^0.3]
    pg.sum().backward()
    assert x.logprobs.grad[0].tolist() == pytest.approx([-math.exp(0.5) + 0.5, -math.exp(0.1), math.exp(-0.2) - 0.5,
                                                         -2 * math.exp(0.3)])


def test_kl_cov_penalty_has_no_gradient_on_policy():
    # At r = 1 the penalty |log r| is 0 and so is its (sub)gradient: one optimizer step from pi_old is -A r alone
    lp = torch.zeros(1, 3, requires_grad=True)
    pg = kl_cov_term(lp - torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 2.0]]), torch.ones(1, 3), 1.0)
    pg.sum().backward()
    assert lp.grad[0].tolist() == [-1.0, 1.0, -2.0]


@pytest.mark.parametrize("policy", [ClipCovConfig(dual_clip=3.0), KLCovConfig(ppo_kl_coef=0.7)], ids=["clip", "kl"])
def test_float64_gradient_check(policy):
    # the selection is a constant of the loss; ratios kept away from PPO's clip edges and from r = 1 (|log r|'s kink)
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(3, 5, generator=g) < 0.5, -1.0, 1.0).double()
    lp = (old + sign * (0.05 + 0.5 * torch.rand(3, 5, generator=g, dtype=torch.float64))).requires_grad_()
    adv = torch.randn(3, 1, generator=g, dtype=torch.float64).expand(3, 5)
    mask = torch.ones(3, 5, dtype=torch.float64)
    selected = torch.rand(3, 5, generator=g) < 0.4

    def loss(logprobs):
        x = LossInputs(logprobs=logprobs, old_logprobs=old, advantages=adv, mask=mask, cov_selected=selected)
        return compute_loss(x, LossConfig(policy=policy)).loss

    assert torch.autograd.gradcheck(loss, (lp,))


LENGTHS = [7, 2, 5, 0, 8, 3, 8, 1]
SPLITS = {"micro": [slice(0, 3), slice(3, 4), slice(4, 8)],
          "dp2x2": [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]}  # 2 learners x 2 micro-batches
# fractions large enough that these 34 tokens select several; Clip-Cov's band around these covariances
POLICIES = [ClipCovConfig(clip_cov_ratio=0.15, clip_cov_lb=0.05, clip_cov_ub=3.0), KLCovConfig(kl_cov_ratio=0.15)]


def _whole_batch(seed=4):
    x = random_inputs(LENGTHS, 8, seed=seed, spread=1.0)
    return LossInputs(**{**x.__dict__, "advantages": x.advantages * 2})  # covariances up to ~3


def _loss_and_grad(x, cfg, parts, selections):
    """Loss summed over the row `parts`, each given its `selections` entry, with the whole batch's counts."""
    lp = x.logprobs.detach().clone().requires_grad_()
    whole = LossInputs(**{**x.__dict__, "logprobs": lp, "entropy": None})
    counts = {"num_tokens": x.mask.sum().item(), "num_seqs": float((x.mask.sum(-1) > 0).sum())}
    total = sum(compute_loss(LossInputs(**{**rows(whole, part, **counts).__dict__, "cov_selected": selected}),
                             cfg).loss for part, selected in zip(parts, selections, strict=True))
    (grad,) = torch.autograd.grad(total, lp)
    return total.item(), grad


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("policy", POLICIES, ids=["clip_cov", "kl_cov"])
def test_the_whole_batch_s_selection_split_with_the_batch_gives_the_whole_batch_s_loss(split, policy):
    x = _whole_batch()
    cfg = LossConfig(policy=policy, correction=RatioCorrection())
    selected = covariance_selection(x.old_logprobs, x.advantages, x.mask, policy, torch.Generator().manual_seed(0))
    assert 2 <= int(selected.sum()) < int(x.mask.sum())
    full_loss, full_grad = _loss_and_grad(x, cfg, [slice(0, 8)], [selected])
    parts = SPLITS[split]
    loss, grad = _loss_and_grad(x, cfg, parts, [selected[part] for part in parts])
    assert loss == pytest.approx(full_loss, rel=1e-6)
    torch.testing.assert_close(grad, full_grad)
    # The control: each part selecting its own tokens, from its own means and its own top fraction (verl selects
    # per micro-batch), cuts or penalises other tokens, and the loss is not the whole batch's.
    own = [covariance_selection(x.old_logprobs[p], x.advantages[p], x.mask[p], policy,
                                torch.Generator().manual_seed(0)) for p in parts]
    assert not torch.equal(torch.cat(own), selected)
    _, grad_own = _loss_and_grad(x, cfg, parts, own)
    assert not torch.allclose(grad_own, full_grad)


def test_the_covariance_losses_refuse_to_run_without_the_selection():
    x = _inputs([False] * 4)
    x = LossInputs(**{**x.__dict__, "cov_selected": None})
    for policy in ("clip_cov", "kl_cov"):
        with pytest.raises(ValueError, match=f"loss.policy.type '{policy}' .* LossInputs.cov_selected"):
            compute_loss(x, LossConfig(policy=policy))


def test_aggregated_kl_cov_penalty_by_hand():
    # token_mean of the penalised term over 4 tokens with coef 1 on the first: (0.5) / 4 more than -A r alone
    x = _inputs([True, False, False, False])
    with_penalty = aggregate(kl_cov_term(x.logprobs - x.old_logprobs, x.advantages, x.cov_selected.float(), 1.0),
                             x.mask, "token_mean")
    without = aggregate(kl_cov_term(x.logprobs - x.old_logprobs, x.advantages, x.cov_selected.float(), 0.0),
                        x.mask, "token_mean")
    assert (with_penalty - without).item() == pytest.approx(0.5 / 4)
