"""rollout_correction: TIS, ICEPop, seq-mask-TIS at token and sequence level, their metrics and invariants."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from distrl.algo import metrics_by_staleness, mismatch_metrics, rollout_correction, weight_metrics
from distrl.config import CorrectionConfig

from .helpers import ragged_mask

E = math.e
# A correction section as the config spells it: `{mode: ..., level: ..., low: ..., high: ...}`.
correction = TypeAdapter(CorrectionConfig).validate_python


def _run(d, mask, **cfg):
    """Weights and metrics for log-ratios d = old - rollout (rollout fixed at -1)."""
    d = torch.as_tensor(d, dtype=torch.float32)
    rollout = torch.full_like(d, -1.0)
    return rollout_correction(rollout + d, rollout, torch.as_tensor(mask, dtype=torch.float32),
                              correction(cfg))


def _close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-6, atol=1e-7)


def test_worked_example_tis():
    # token ratios e^1, e^0, e^-2 = 2.718, 1, 0.135 into [0.5, 2] -> [2, 1, 0.5]
    w, m = _run([[1.0, 0.0, -2.0]], [[1, 1, 1]], mode="tis", low=0.5, high=2.0)
    assert w[0].tolist() == pytest.approx([2.0, 1.0, 0.5])
    assert m["is_frac_truncated"].item() == pytest.approx(2 / 3)
    assert m["is_weight_mean"].item() == pytest.approx(3.5 / 3)
    assert (m["is_weight_min"].item(), m["is_weight_max"].item()) == pytest.approx((0.5, 2.0))
    # ESS = (2 + 1 + 0.5)^2 / (3 (4 + 1 + 0.25)) = 12.25 / 15.75
    assert m["is_ess"].item() == pytest.approx(12.25 / 15.75)
    # mismatch_kl = mean(rollout - old) = -(1 + 0 - 2) / 3; k3 = mean(e^d - 1 - d) = ((e - 2) + 0 + (e^-2 + 1)) / 3
    assert m["mismatch_kl"].item() == pytest.approx(1 / 3)
    assert m["mismatch_k3"].item() == pytest.approx(((E - 2) + (math.exp(-2) + 1)) / 3)


def test_worked_example_icepop():
    # the same ratios: e^1 > 2 and e^-2 < 0.5 are zeroed, 1 is kept -> [0, 1, 0]
    w, m = _run([[1.0, 0.0, -2.0]], [[1, 1, 1]], mode="icepop", low=0.5, high=2.0)
    assert w[0].tolist() == pytest.approx([0.0, 1.0, 0.0])
    assert m["is_frac_masked"].item() == pytest.approx(2 / 3) and "is_frac_truncated" not in m
    # ESS = 1^2 / (3 x 1) = 1/3
    assert m["is_ess"].item() == pytest.approx(1 / 3)
    assert (m["is_weight_min"].item(), m["is_weight_max"].item()) == (0.0, 1.0)


def test_icepop_keeps_ratios_on_the_bounds():
    # ratios exactly 0.5 and 2 are inside [low, high]
    w, _ = _run([[math.log(0.5), math.log(2.0)]], [[1, 1]], mode="icepop", low=0.5, high=2.0)
    assert w[0].tolist() == pytest.approx([0.5, 2.0])


# Sequence level, [low, high] = [0.5, 2]:
#   row 0: d = [1, 0, -2]      sum -1  -> product ratio e^-1 = 0.368 (below 0.5)
#   row 1: d = [0.3, -0.1, pad] sum 0.2 -> e^0.2 = 1.2214 (inside)
#   row 2: d = [0.5, 0.2, pad]  sum 0.7 -> e^0.7 = 2.0138 (above 2)
SEQ_D = [[1.0, 0.0, -2.0], [0.3, -0.1, 9.0], [0.5, 0.2, -9.0]]
SEQ_MASK = [[1, 1, 1], [1, 1, 0], [1, 1, 0]]


def test_sequence_level_tis():
    w, m = _run(SEQ_D, SEQ_MASK, mode="tis", level="sequence", low=0.5, high=2.0)
    _close(w, [[0.5] * 3, [math.exp(0.2)] * 2 + [0.0], [2.0, 2.0, 0.0]])
    assert m["is_frac_truncated"].item() == pytest.approx(5 / 7)  # rows 0 and 2: 3 + 2 of 7 valid tokens


def test_sequence_level_icepop():
    w, m = _run(SEQ_D, SEQ_MASK, mode="icepop", level="sequence", low=0.5, high=2.0)
    _close(w, [[0.0] * 3, [math.exp(0.2)] * 2 + [0.0], [0.0] * 3])
    assert m["is_frac_masked"].item() == pytest.approx(5 / 7)


def test_seq_mask_tis():
    # geometric means: row 0 e^(-1/3) = 0.717 (kept), row 1 e^0.1 = 1.105 (kept), row 2 e^0.35 = 1.419 (kept);
    # row 3: d = [1, 0.6] mean 0.8 -> e^0.8 = 2.2255 > 2 -> every token zeroed.
    # Kept rows use the RAW token ratios, which may lie outside [low, high] (e^1, e^-2 in row 0).
    w, m = _run([*SEQ_D, [1.0, 0.6, 0.0]], [*SEQ_MASK, [1, 1, 0]], mode="seq_mask_tis", low=0.5, high=2.0)
    _close(w, [[E, 1.0, math.exp(-2)], [math.exp(0.3), math.exp(-0.1), 0.0],
               [math.exp(0.5), math.exp(0.2), 0.0], [0.0, 0.0, 0.0]])
    assert m["is_frac_masked"].item() == pytest.approx(2 / 9)


def test_weights_are_detached_and_zero_on_padding():
    old = torch.randn(3, 4, requires_grad=True)
    rollout = torch.randn(3, 4, requires_grad=True)
    mask = ragged_mask([4, 2, 0], 4)
    w, metrics = rollout_correction(old, rollout, mask, correction({"mode": "tis", "low": 0.0, "high": 2.0}))
    assert not w.requires_grad and not any(v.requires_grad for v in metrics.values())
    assert (w[mask == 0] == 0).all()


def test_empty_mask_metrics_are_zero_not_nan():
    _, m = _run([[0.3, 0.1]], [[0, 0]], mode="icepop", low=0.5, high=2.0)
    assert all(v.item() == 0.0 for v in m.values()), m


def test_mismatch_metrics_alone():
    # d = old - rollout = [0.5, -0.5]: k1 = mean(rollout - old) = 0; k3 = ((e^0.5 - 1.5) + (e^-0.5 - 0.5)) / 2
    m = mismatch_metrics(torch.tensor([[0.5, -0.5, 7.0]]), torch.zeros(1, 3), torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["mismatch_kl"].item() == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch_k3"].item() == pytest.approx((math.exp(0.5) - 1.5 + math.exp(-0.5) - 0.5) / 2)


@st.composite
def _batches(draw):
    b, t = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    d = draw(st.lists(st.floats(-30, 30, width=32), min_size=b * t, max_size=b * t))
    lengths = draw(st.lists(st.integers(0, t), min_size=b, max_size=b))
    low = draw(st.floats(0.0, 0.9))
    high = draw(st.floats(1.1, 5.0))
    garbage = draw(st.sampled_from([0.0, 1e6, -1e6, math.nan, math.inf]))
    return torch.tensor(d).view(b, t), ragged_mask(lengths, t), low, high, garbage


@settings(max_examples=60, deadline=None)
@given(_batches(), st.sampled_from([("tis", "token"), ("tis", "sequence"), ("icepop", "token"),
                                    ("icepop", "sequence"), ("seq_mask_tis", None)]))
def test_weight_invariants(batch, mode_level):
    d, mask, low, high, garbage = batch
    mode, level = mode_level
    # padding of both inputs holds garbage: it must not matter
    old = torch.where(mask.bool(), d - 1.0, garbage)
    rollout = torch.where(mask.bool(), torch.full_like(d, -1.0), -garbage)
    cfg = correction({"mode": mode, "low": low, "high": high, **({"level": level} if level else {})})
    w, m = rollout_correction(old, rollout, mask, cfg)
    clean, _ = rollout_correction(d - 1.0, torch.full_like(d, -1.0), mask, cfg)
    assert torch.equal(w, clean)
    assert torch.isfinite(w).all() and (w >= 0).all() and (w[mask == 0] == 0).all()
    valid = w[mask.bool()]
    in_bounds = (valid >= low * (1 - 1e-6)) & (valid <= high * (1 + 1e-6))
    if mode == "tis":
        assert in_bounds.all()
    elif mode == "icepop":
        assert (in_bounds | (valid == 0)).all()
    else:  # whole sequences are zeroed or kept with their raw ratios
        d = (d - 1.0) + 1.0  # the log-ratio exactly as the function sees it (old - rollout, rounded)
        geo = torch.exp(((d * mask).sum(-1) / mask.sum(-1).clamp(min=1)).clamp(-20, 20))
        kept = (geo >= low) & (geo <= high)
        expected = torch.where(kept[:, None], torch.exp(d.clamp(-20, 20)), 0.0) * mask
        torch.testing.assert_close(w, expected)
    assert 0.0 <= m["is_ess"].item() <= 1.0 + 1e-6
    assert all(math.isfinite(v.item()) for v in m.values())


def test_mismatch_figures_split_by_each_tokens_own_staleness():
    """A multi-turn episode's turns may come from different versions: staleness per token `[B, T]`.
    d = old - rollout: row 0 = [-1, -2, -4] with staleness [0, 0, 1]; row 1 = [-3, 0, 0] with [1, 2, 2], its last
    token padding. mismatch_kl = mean(-d): bucket 0 over {1, 2} = 1.5; bucket 1 over {4, 3} = 3.5; bucket 2 over {0}
    = 0 (padding left out)."""
    old = torch.tensor([[-1.0, -2.0, -4.0], [-3.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    staleness = torch.tensor([[0, 0, 1], [1, 2, 2]])
    figures = metrics_by_staleness(old, torch.zeros(2, 3), mask, staleness, None)
    assert {k: float(v["mismatch_kl"]) for k, v in figures.items()} == {"0": 1.5, "1": 3.5, "2": 0.0}
    per_row = metrics_by_staleness(old, torch.zeros(2, 3), mask, torch.tensor([0, 1]), None)  # [B]: whole rows
    assert {k: float(v["mismatch_kl"]) for k, v in per_row.items()} == {"0": pytest.approx(7 / 3), "1": 1.5}


def test_each_age_up_to_3_has_its_bucket_and_older_tokens_share_4_plus():
    """d = old - rollout = [-1, -2, -3, -4, -6] at staleness [2, 3, 4, 5, 4]: mismatch_kl = mean(-d) is 1 at age 2, 2
    at age 3 and (3 + 4 + 6) / 3 = 13/3 over ages 4 and 5 (bucket 4+)."""
    old = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -6.0]])
    figures = metrics_by_staleness(old, torch.zeros(1, 5), torch.ones(1, 5), torch.tensor([[2, 3, 4, 5, 4]]), None)
    assert {k: float(v["mismatch_kl"]) for k, v in figures.items()} == {"2": 1.0, "3": 2.0,
                                                                        "4+": pytest.approx(13 / 3)}


def test_ess_of_equal_weights_is_one_and_of_one_dominant_weight_one_over_n():
    # ESS = (sum w)^2 / (N sum w^2): [1, 1, 1, 1] -> 16 / (4 x 4) = 1; [4, 0, 0, 0] -> 16 / (4 x 16) = 1/4
    mask = torch.ones(1, 4)
    assert weight_metrics(torch.ones(1, 4), mask)["is_ess"].item() == pytest.approx(1.0)
    assert weight_metrics(torch.tensor([[4.0, 0.0, 0.0, 0.0]]), mask)["is_ess"].item() == pytest.approx(0.25)


def test_ess_and_truncated_share_split_by_staleness_by_hand():
    """TIS into [0, 2]. Row 0: ratios [1.5, 1, e^2] with staleness [0, 0, 1]; row 1: ratios [0.5, 0.5, -] with
    staleness 1 (its last token padding).
    Staleness 0, weights [1.5, 1]: ESS = 2.5^2 / (2 (2.25 + 1)) = 6.25 / 6.5 = 25/26, nothing truncated.
    Staleness 1, weights [2 (e^2 truncated), 0.5, 0.5]: ESS = 3^2 / (3 (4 + 0.25 + 0.25)) = 9 / 13.5 = 2/3,
    truncated 1 of 3."""
    old = torch.tensor([[math.log(1.5), 0.0, 2.0], [math.log(0.5), math.log(0.5), 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    staleness = torch.tensor([[0, 0, 1], [1, 1, 1]])
    figures = metrics_by_staleness(old, torch.zeros(2, 3), mask, staleness, correction({"mode": "tis"}))
    assert set(figures) == {"0", "1"}  # no token of staleness 2 or more: no bucket
    assert figures["0"]["is_ess"].item() == pytest.approx(25 / 26)
    assert figures["1"]["is_ess"].item() == pytest.approx(2 / 3)
    assert figures["0"]["is_frac_truncated"].item() == 0.0
    assert figures["1"]["is_frac_truncated"].item() == pytest.approx(1 / 3)
