"""The fused `compute_loss` against `reference_loss`, the plain composition under autograd, on every mode: the loss
and every metric bit for bit, the gradients to float rounding, with NaN / inf / huge values in the padding."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from distrl.algo import LossInputs, compute_loss, reference_loss
from distrl.config import LossConfig
from distrl.merging import Merge

from .helpers import padded_batch, random_inputs

LENGTHS = [7, 2, 5, 0, 8, 3, 8, 1]
AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm")
SEQUENCE_LEVEL = ("gspo", "gmpo")  # no aggregation to choose
DUAL_CLIP = ("ppo", "clip_cov")
OWN = {"ppo": {}, "gspo": {}, "cispo": {"clip_low": 0.2, "clip_high": 0.2}, "sapo": {"tau_pos": 1.0, "tau_neg": 2.0},
       "gmpo": {}, "gpg": {}, "clip_cov": {}, "kl_cov": {"ppo_kl_coef": 0.5}}
"""Each type's parameters here: clip ranges that these batches (log-ratios spread ~1) cross on both sides."""
POLICY_AGGREGATIONS = [("ppo", a) for a in AGGREGATIONS] + [("gspo", "seq_mean_token_mean")]
OTHER_POLICY_AGGREGATIONS = [(p, a) for p in ("cispo", "sapo", "gpg", "clip_cov", "kl_cov") for a in AGGREGATIONS] + [
    ("gmpo", "seq_mean_token_mean")]
CORRECTIONS = {"none": None, "tis": {"mode": "tis", "low": 0.5, "high": 1.5},
               "tis_seq": {"mode": "tis", "level": "sequence", "low": 0.3, "high": 3.0},
               "icepop": {"mode": "icepop", "low": 0.6, "high": 1.4},
               "icepop_seq": {"mode": "icepop", "level": "sequence", "low": 0.3, "high": 3.0},
               "seq_mask_tis": {"mode": "seq_mask_tis", "low": 0.7, "high": 1.4},
               "tis_below_one": {"mode": "tis", "low": 0.1, "high": 0.5}}
KLS = {"no_ref": None, "k1": {"coef": 0.1, "estimator": "k1"}, "k2": {"coef": 0.1, "estimator": "k2"},
       "k3": {"coef": 0.1, "estimator": "k3"}, "k3+": {"coef": 0.1, "estimator": "k3+"},
       "reward": {"coef": 0.1, "estimator": "k3", "target": "reward"}}


def loss_cfg(policy: str = "ppo", aggregation: str = "token_mean", dual_clip: float | None = None,
             correction: dict | None = None, kl: dict | None = None, entropy_coef: float = 0.0) -> LossConfig:
    """The typed loss config from flat settings: a sequence-level type (gspo, gmpo) has no aggregation to choose,
    and only ppo and clip_cov have a dual clip."""
    objective = {"type": policy, **OWN[policy]}
    if policy not in SEQUENCE_LEVEL:
        objective["aggregation"] = aggregation
    if policy in DUAL_CLIP:
        objective["dual_clip"] = dual_clip
    return LossConfig.model_validate({"policy": objective, "correction": correction, "kl": kl or {},
                                      "entropy_coef": entropy_coef})


def _inputs(seed: int, with_rollout: bool, with_ref: bool, global_counts: bool) -> LossInputs:
    x = random_inputs(LENGTHS, 8, seed=seed, spread=1.0)
    with torch.no_grad():  # log-ratios past the +-20 and +-10 clamps, where the gradient must be 0
        x.old_logprobs[0, :3] = torch.tensor([-25.0, 0.0, 3.0])
        x.logprobs[0, :3] = torch.tensor([0.0, -30.0, -12.0])
        x.logprobs[2, :2] = torch.tensor([-0.2, -14.0])
    extra = {"num_tokens": 60.0, "num_seqs": 9.0, "norm_len": 10} if global_counts else {}
    return LossInputs(logprobs=x.logprobs, old_logprobs=x.old_logprobs, advantages=x.advantages, mask=x.mask,
                      rollout_logprobs=x.rollout_logprobs if with_rollout else None,
                      ref_logprobs=x.ref_logprobs if with_ref else None, entropy=x.entropy,
                      cov_selected=x.cov_selected, **extra)


def _fresh(x: LossInputs) -> LossInputs:
    """The same values with new leaves, so two runs' gradients stay apart."""
    return LossInputs(**{**x.__dict__, "logprobs": x.logprobs.detach().clone().requires_grad_(),
                         "entropy": None if x.entropy is None else x.entropy.detach().clone().requires_grad_()})


def _compare(x: LossInputs, cfg: LossConfig) -> None:
    a, b = _fresh(x), _fresh(x)
    ref_loss, ref_metrics = reference_loss(a, cfg)
    out = compute_loss(b, cfg)
    assert torch.equal(out.loss.detach(), ref_loss.detach()), (out.loss.item(), ref_loss.item())
    assert {k: f.value for k, f in out.metrics.items()} == {k: v.item() for k, v in ref_metrics.items()}
    ref_loss.backward()
    out.loss.backward()
    for fused, ref in ((b.logprobs, a.logprobs), (b.entropy, a.entropy)):
        if ref.grad is None:
            assert fused.grad is None or not fused.grad.any()
        else:
            # products formed in another order differ by an ulp; where the policy and KL terms nearly cancel, that
            # ulp is large relative to their sum, so the absolute tolerance follows the gradient's scale
            scale = float(ref.grad.abs().max())
            torch.testing.assert_close(fused.grad, ref.grad, rtol=1e-6, atol=1e-6 * scale + 1e-12)


@pytest.mark.parametrize(("policy", "aggregation"), POLICY_AGGREGATIONS)
@pytest.mark.parametrize("correction", list(CORRECTIONS))
@pytest.mark.parametrize("kl", list(KLS))
def test_fused_equals_reference(policy, aggregation, correction, kl):
    for dual_clip, entropy_coef, global_counts in itertools.product([None, 2.0], [0.0, 0.01], [False, True]):
        cfg = loss_cfg(policy, aggregation, dual_clip, CORRECTIONS[correction], KLS[kl], entropy_coef)
        for with_rollout in ([True] if cfg.correction is not None else [False, True]):
            _compare(_inputs(seed=len(correction) + len(kl), with_rollout=with_rollout, with_ref=KLS[kl] is not None,
                             global_counts=global_counts), cfg)


@pytest.mark.parametrize(("policy", "aggregation"), OTHER_POLICY_AGGREGATIONS)
@pytest.mark.parametrize("correction", ["none", "tis", "icepop_seq", "seq_mask_tis"])
@pytest.mark.parametrize("kl", ["no_ref", "k3+", "reward"])
def test_fused_equals_reference_for_the_other_losses(policy, aggregation, correction, kl):
    # The composition and the aggregations are those of ppo above, tested on every mode; here each other loss's
    # term against its definition, with each kind of correction and KL.
    for dual_clip, entropy_coef, global_counts in itertools.product([None, 2.0], [0.0, 0.01], [False, True]):
        cfg = loss_cfg(policy, aggregation, dual_clip, CORRECTIONS[correction], KLS[kl], entropy_coef)
        _compare(_inputs(seed=len(correction) + len(kl) + len(policy), with_rollout=cfg.correction is not None,
                         with_ref=KLS[kl] is not None, global_counts=global_counts), cfg)


@settings(max_examples=150, deadline=None)
@given(padded_batch(), st.sampled_from(POLICY_AGGREGATIONS + OTHER_POLICY_AGGREGATIONS),
       st.sampled_from(list(CORRECTIONS.values())),
       st.sampled_from(["k1", "k2", "k3", "k3+"]), st.sampled_from([None, 2.0]))
def test_fused_equals_reference_with_garbage_in_padding(batch, policy_aggregation, correction, estimator, dual_clip):
    lengths, t, fills, seed = batch
    policy, aggregation = policy_aggregation
    cfg = loss_cfg(policy, aggregation, dual_clip, correction, {"coef": 0.1, "estimator": estimator}, 0.01)
    x = random_inputs(lengths, t, seed=seed, spread=1.0)
    with torch.no_grad():
        for name, value in fills.items():
            getattr(x, name)[x.mask == 0] = value
    _compare(x, cfg)


def test_bool_mask_and_non_unit_mask_values_count_as_valid():
    x = random_inputs([3, 1], 4, seed=1, spread=1.0)
    cfg = loss_cfg(correction={}, kl={"coef": 0.1}, entropy_coef=0.01)
    _compare(x, cfg)
    _compare(LossInputs(**{**x.__dict__, "mask": x.mask.bool()}), cfg)
    _compare(LossInputs(**{**x.__dict__, "mask": x.mask * 2.5}), cfg)


def test_bfloat16_logprobs_get_a_bfloat16_gradient():
    x = random_inputs([3, 4], 4, seed=2, spread=1.0)
    x = LossInputs(**{**x.__dict__, "logprobs": x.logprobs.detach().bfloat16().requires_grad_()})
    _compare(x, loss_cfg(correction={}, kl={"coef": 0.1}, entropy_coef=0.01))


def test_each_metric_states_how_it_merges():
    cfg = loss_cfg(correction={}, kl={"coef": 0.1}, entropy_coef=0.01, dual_clip=3.0)
    merges = {key: fig.merge for key, fig in compute_loss(random_inputs([3, 2], 4), cfg).metrics.items()}
    assert {k for k, m in merges.items() if m is Merge.SUM} == {"loss/policy", "loss/kl", "loss/entropy", "loss/total"}
    assert merges["is_weight_min"] is Merge.MIN and merges["is_weight_max"] is Merge.MAX
    means = {"clip_frac", "dual_clip_frac", "ppo_kl", "kl_ref", "entropy", "is_weight_mean", "is_ess",
             "is_frac_truncated", "mismatch_kl", "mismatch_k3"}
    assert {k for k, m in merges.items() if m is Merge.TOKEN_MEAN} == means


def test_no_gradient_asked_gives_a_plain_tensor():
    x = random_inputs([3, 2], 4)
    with torch.no_grad():
        out = compute_loss(x, LossConfig(entropy_coef=0.01))
    assert not out.loss.requires_grad
    ref_loss, _ = reference_loss(x, LossConfig(entropy_coef=0.01))
    assert torch.equal(out.loss, ref_loss.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_zero_padding_by_bits_is_where_bit_for_bit(dtype):
    from distrl.algo.fused_loss import Tokens

    x = torch.tensor([[math.nan, -0.0, math.inf, 1e30], [-math.inf, 2.5, -0.0, math.nan]], dtype=dtype)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    got = Tokens(mask, torch.float32).zero_padding(x)
    want = torch.where(mask != 0, x, 0)
    int_type = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}[dtype]
    assert torch.equal(got.view(int_type), want.view(int_type))  # the same bits, NaN and -0 included


def test_strided_inputs():
    # advantages as a broadcast view of one value per sequence, log-probs as a column slice of a wider tensor
    x = random_inputs([5, 2, 0, 6], 6, seed=4, spread=1.0)
    wide = torch.zeros(4, 9)
    wide[:, 2:8] = x.old_logprobs
    strided = LossInputs(**{**x.__dict__, "advantages": x.advantages[:, :1].expand(4, 6),
                            "old_logprobs": wide[:, 2:8]})
    assert not strided.old_logprobs.is_contiguous() and strided.advantages.stride() == (6, 0)
    _compare(strided, loss_cfg("gspo", correction={"mode": "icepop"}, kl={"coef": 0.1},
                                 entropy_coef=0.01))
