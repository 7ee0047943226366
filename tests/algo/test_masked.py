"""aggregate and the masked reductions, on hand-worked cases."""

import math

import pytest
import torch

from distrl.algo import aggregate, masked_mean

# values:            mask:
#   [1, 2, 3]          [1, 1, 0]   -> row sum 3, length 2, token mean 1.5
#   [4, 5, 6]          [1, 0, 0]   -> row sum 4, length 1, token mean 4
#   [7, 8, 9]          [0, 0, 0]   -> empty: ignored by every mode
VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 7 / 3),  # (1 + 2 + 4) / 3 tokens
        ("seq_mean_token_mean", 2.75),  # (1.5 + 4) / 2 non-empty sequences
        ("seq_mean_token_sum", 3.5),  # (3 + 4) / 2
        ("seq_mean_token_sum_norm", 7 / 6),  # (3 + 4) / (2 sequences x T=3)
    ],
)
def test_aggregate_modes(mode, expected):
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_uses_norm_len():
    # (3 + 4) / (2 x 4)
    assert aggregate(VALUES, MASK, "seq_mean_token_sum_norm", norm_len=4).item() == pytest.approx(7 / 8)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token_mean", 7 / 10),  # local sum 7 over 10 global tokens
        ("seq_mean_token_mean", 5.5 / 4),  # local per-sequence means 1.5 + 4 over 4 global sequences
        ("seq_mean_token_sum", 7 / 4),
        ("seq_mean_token_sum_norm", 7 / (4 * 3)),
    ],
)
def test_global_normalisers_replace_local_counts(mode, expected):
    assert aggregate(VALUES, MASK, mode, num_tokens=10, num_seqs=4).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_empty_mask_gives_zero_with_graph(mode):
    values = torch.randn(2, 3, requires_grad=True)
    out = aggregate(values, torch.zeros(2, 3), mode)
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_padding_values_never_leak(mode):
    values = VALUES.clone()
    values[MASK == 0] = torch.tensor([math.nan, math.inf, -math.inf, 1e30, math.nan, -1e30])
    values.requires_grad_()
    out = aggregate(values, MASK, mode)
    assert out.item() == pytest.approx(aggregate(VALUES, MASK, mode).item())
    out.backward()
    assert torch.isfinite(values.grad).all() and (values.grad[MASK == 0] == 0).all()


def test_bool_and_float_masks_agree():
    for mode in ("token_mean", "seq_mean_token_mean"):
        assert aggregate(VALUES, MASK.bool(), mode).item() == aggregate(VALUES, MASK, mode).item()


def test_unknown_mode_is_an_error():
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(VALUES, MASK, "sum")


def test_masked_mean_along_dim():
    # rows: 1.5, 4, empty -> 0 (not NaN)
    assert masked_mean(VALUES, MASK, dim=-1).tolist() == [1.5, 4.0, 0.0]
    assert masked_mean(VALUES, MASK).item() == pytest.approx(7 / 3)
