"""compute_loss: the composed objective by hand, required inputs, where gradient may flow, micro-batch / data-parallel
equivalence with global normalisers, and invariance to whatever sits in the padding."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distrl.algo import LossInputs, compute_loss
from distrl.config import (
    CISPOConfig,
    ClipCovConfig,
    GMPOConfig,
    GPGConfig,
    GSPOConfig,
    KLCovConfig,
    KLInLoss,
    KLInReward,
    LossConfig,
    PPOConfig,
    RatioCorrection,
    SAPOConfig,
    SeqMaskTISCorrection,
)
from distrl.merging import values

from .helpers import padded_batch, ragged_mask, random_inputs, rows

AGGREGATIONS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]


def _hand_inputs(**kw):
    # one sequence, two tokens, third is padding; logprobs == old_logprobs (ratio 1)
    return LossInputs(logprobs=torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True),
                      old_logprobs=torch.tensor([[-1.0, -2.0, 0.0]]), advantages=torch.tensor([[1.0, 2.0, 0.0]]),
                      mask=torch.tensor([[1.0, 1.0, 0.0]]), **kw)


def test_objective_by_hand():
    # pg = -A r = [-1, -2]; TIS: rollout = old - [ln 4, 0] -> ratios [4, 1] -> w = [2, 1] (high 2)
    # aggregate(w * pg) = mean(-2, -2) = -2
    # kl k1 = logprobs - ref = [0.2, 0.4] -> mean 0.3, x 0.1 = 0.03
    # entropy [1, 3] -> mean 2, x 0.01 = 0.02
    # loss = -2 + 0.03 - 0.02 = -1.99
    inputs = _hand_inputs(rollout_logprobs=torch.tensor([[-1.0 - math.log(4), -2.0, 0.0]]),
                          ref_logprobs=torch.tensor([[-1.2, -2.4, 0.0]]), entropy=torch.tensor([[1.0, 3.0, 0.0]]))
    cfg = LossConfig(kl=KLInLoss(coef=0.1, estimator="k1"), entropy_coef=0.01,
                     correction=RatioCorrection(mode="tis", low=0.0, high=2.0))
    out = compute_loss(inputs, cfg)
    assert out.loss.item() == pytest.approx(-1.99)
    m = values(out.metrics)
    assert (m["loss/policy"], m["loss/kl"], m["loss/entropy"], m["loss/total"]) == pytest.approx((-2, 0.3, 2, -1.99))
    assert (m["kl_ref"], m["entropy"], m["ppo_kl"], m["clip_frac"]) == pytest.approx((0.3, 2.0, 0.0, 0.0))
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_frac_truncated"] == pytest.approx(0.5)
    assert all(isinstance(v, float) for v in m.values())
    # d loss / d logprobs: policy -A w r / 2 = [-1, -1]; kl +0.1 x 1 / 2 = 0.05 each; padding 0
    out.loss.backward()
    assert inputs.logprobs.grad[0].tolist() == pytest.approx([-0.95, -0.95, 0.0])


def test_clip_metrics_by_hand():
    # ratios e^0.5 = 1.65 (A = 1: clipped), e^0 = 1 (not), e^2 = 7.39 (A = -1: dual clip at 3), padding
    # clip_frac 1/3, dual_clip_frac 1/3, ppo_kl = mean(old - new) = -(0.5 + 0 + 2) / 3
    inputs = LossInputs(logprobs=torch.tensor([[0.5, 0.0, 2.0, 9.0]]), old_logprobs=torch.zeros(1, 4),
                        advantages=torch.tensor([[1.0, 1.0, -1.0, 1.0]]), mask=torch.tensor([[1.0, 1, 1, 0]]))
    out = compute_loss(inputs, LossConfig(policy=PPOConfig(dual_clip=3.0)))
    m = values(out.metrics)
    assert m["clip_frac"] == pytest.approx(1 / 3) and m["dual_clip_frac"] == pytest.approx(1 / 3)
    assert m["ppo_kl"] == pytest.approx(-2.5 / 3)
    # loss = mean(-1.2, -1, 3) = 0.2667
    assert out.loss.item() == pytest.approx(0.8 / 3)


def test_kl_in_reward_is_not_in_the_loss_but_is_reported():
    inputs = _hand_inputs(ref_logprobs=torch.tensor([[-1.2, -2.4, 0.0]]))
    with_reward = compute_loss(inputs, LossConfig(kl=KLInReward(coef=0.1, estimator="k1")))
    without = compute_loss(_hand_inputs(), LossConfig())
    assert with_reward.loss.item() == without.loss.item() == pytest.approx(-1.5)
    m = values(with_reward.metrics)
    assert m["kl_ref"] == pytest.approx(0.3) and m["loss/kl"] == 0.0


def test_mismatch_metrics_without_correction():
    out = compute_loss(_hand_inputs(rollout_logprobs=torch.tensor([[-1.5, -2.0, 0.0]])), LossConfig())
    # mismatch_kl = mean(rollout - old) = (-0.5 + 0) / 2
    assert values(out.metrics)["mismatch_kl"] == pytest.approx(-0.25) and "is_ess" not in out.metrics


@pytest.mark.parametrize(
    ("cfg", "missing", "match"),
    [
        (LossConfig(kl=KLInLoss(coef=0.1)), {}, "ref_logprobs"),
        (LossConfig(entropy_coef=0.01), {}, "entropy"),
        (LossConfig(correction=RatioCorrection()), {}, "rollout_logprobs"),
    ],
)
def test_missing_inputs_are_clear_errors(cfg, missing, match):
    with pytest.raises(ValueError, match=match):
        compute_loss(_hand_inputs(**missing), cfg)


def test_shape_mismatch_is_an_error():
    inputs = _hand_inputs(ref_logprobs=torch.zeros(1, 2))
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_loss(inputs, LossConfig())


FULL_CFG = {"kl": KLInLoss(coef=0.05, estimator="k3+"), "entropy_coef": 0.01}
# every aggregation for ppo (with a dual clip); gspo is sequence-level, so it has none to choose. Its clip range is
# widened from the paper's 3e-4 / 4e-4 so that these random batches have ratios on both sides of the clip.
POLICIES = [PPOConfig(aggregation=a, dual_clip=3.0) for a in AGGREGATIONS] + [GSPOConfig(clip_low=0.2, clip_high=0.2)]
# the other losses, each with every aggregation it has (cispo's clip narrowed so that its weights clip here)
POLICIES += [policy for a in AGGREGATIONS for policy in (
    CISPOConfig(aggregation=a, clip_low=0.2, clip_high=0.2), SAPOConfig(aggregation=a), GPGConfig(aggregation=a),
    ClipCovConfig(aggregation=a, dual_clip=3.0), KLCovConfig(aggregation=a, ppo_kl_coef=0.5))] + [GMPOConfig()]
POLICY_IDS = [f"{p.type}-{p.aggregation}" for p in POLICIES]


@pytest.mark.parametrize("policy", [POLICIES[1], POLICIES[-1]], ids=["ppo", "gspo"])
def test_gradient_reaches_only_logprobs_and_entropy(policy):
    inputs = random_inputs([5, 3, 6, 0], 6)
    constants = [inputs.old_logprobs, inputs.rollout_logprobs, inputs.ref_logprobs, inputs.advantages]
    for x in constants:
        x.requires_grad_()
    cfg = LossConfig(policy=policy, correction=RatioCorrection(), **FULL_CFG)
    compute_loss(inputs, cfg).loss.backward()
    assert all(x.grad is None or not x.grad.any() for x in constants)
    assert inputs.logprobs.grad.abs().sum() > 0 and inputs.entropy.grad.abs().sum() > 0


def _full_and_shards(lengths, t, cfg, shards):
    """Loss and grads of the whole batch, and summed over `shards` (row slices) with global normalisers."""
    full = random_inputs(lengths, t, seed=3)
    full_loss = compute_loss(full, cfg).loss
    full_grads = torch.autograd.grad(full_loss, [full.logprobs, full.entropy])

    parts = random_inputs(lengths, t, seed=3)
    num_tokens = parts.mask.sum().item()
    num_seqs = (parts.mask.sum(-1) > 0).sum().item()
    total = sum(compute_loss(rows(parts, s, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=t), cfg).loss
                for s in shards)
    part_grads = torch.autograd.grad(total, [parts.logprobs, parts.entropy])
    return full_loss, full_grads, total, part_grads


# 8 sequences (one empty); micro-batches of uneven size, and 2 data-parallel learners x 2 micro-batches each
LENGTHS = [7, 2, 5, 0, 8, 3, 8, 1]
SPLITS = {"micro": [slice(0, 3), slice(3, 4), slice(4, 8)],
          "dp2x2": [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]}
CORRECTIONS = [RatioCorrection(mode="tis", level="token", low=0.5, high=1.5),
               RatioCorrection(mode="icepop", level="sequence", low=0.3, high=3.0),
               SeqMaskTISCorrection(low=0.7, high=1.4)]


@pytest.mark.parametrize("split", list(SPLITS))
@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
@pytest.mark.parametrize("correction", range(len(CORRECTIONS)))
def test_sharded_loss_sums_to_full_batch(split, policy, correction):
    cfg = LossConfig(policy=policy, correction=CORRECTIONS[correction], **FULL_CFG)
    full_loss, full_grads, total, part_grads = _full_and_shards(LENGTHS, 8, cfg, SPLITS[split])
    assert total.item() == pytest.approx(full_loss.item(), rel=1e-5, abs=1e-6)
    for a, b in zip(full_grads, part_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_local_normalisers_would_not_sum_up(policy):
    # The control for the test above: without global counts, shard losses do not add up to the full loss.
    cfg = LossConfig(policy=policy, **FULL_CFG)
    full = random_inputs(LENGTHS, 8, seed=3)
    shards = sum(compute_loss(rows(full, s), cfg).loss for s in SPLITS["micro"]).item()
    assert shards != pytest.approx(compute_loss(full, cfg).loss.item(), rel=1e-3)


@settings(max_examples=60, deadline=None)
@given(padded_batch(), st.sampled_from(POLICIES), st.sampled_from([*CORRECTIONS, None]),
       st.sampled_from(["k1", "k2", "k3", "k3+"]))
def test_padding_content_never_matters(batch, policy, correction, estimator):
    lengths, t, fills, seed = batch
    if isinstance(policy, PPOConfig | ClipCovConfig):
        policy = policy.model_copy(update={"dual_clip": 2.0})
    cfg = LossConfig(policy=policy, correction=correction, kl=KLInLoss(coef=0.1, estimator=estimator),
                     entropy_coef=0.01)
    clean = random_inputs(lengths, t, seed=seed, spread=1.0)
    dirty = random_inputs(lengths, t, seed=seed, spread=1.0)
    pad = dirty.mask == 0
    with torch.no_grad():
        for name, value in fills.items():
            getattr(dirty, name)[pad] = value
    a, b = compute_loss(clean, cfg), compute_loss(dirty, cfg)
    assert math.isfinite(b.loss.item()) and b.loss.item() == a.loss.item()
    assert a.metrics == b.metrics
    a.loss.backward()
    b.loss.backward()
    for x, y in ((clean.logprobs, dirty.logprobs), (clean.entropy, dirty.entropy)):
        assert torch.equal(x.grad, y.grad) and (y.grad[pad] == 0).all()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), st.integers(0, 2**16))
def test_masked_tokens_get_no_gradient_and_empty_batches_are_finite(lengths, seed):
    inputs = random_inputs(lengths, 5, seed=seed)
    cfg = LossConfig(policy=PPOConfig(aggregation="seq_mean_token_sum", dual_clip=3.0), correction=RatioCorrection(),
                     **FULL_CFG)
    out = compute_loss(inputs, cfg)
    out.loss.backward()
    assert math.isfinite(out.loss.item()) and all(math.isfinite(v) for v in values(out.metrics).values())
    assert (inputs.logprobs.grad[ragged_mask(lengths, 5) == 0] == 0).all()
