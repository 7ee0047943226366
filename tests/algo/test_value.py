"""Clipped value loss worked by hand."""

import pytest
import torch

from distrl.algo import explained_variance, value_loss


def test_value_loss_clipped_and_unclipped_tokens():
    # token 0: v 1.1, v_old 1.0, R 1.5: inside the clip range, both branches (1.1 - 1.5)^2 = 0.16
    # token 1: v 2.0, v_old 1.0, R 1.0: unclipped 1.0; clipped v -> 1.2: 0.04; max 1.0 (unclipped)
    # token 2: v 0.5, v_old 1.0, R 0.4: unclipped 0.01; clipped v -> 0.8: 0.16; max 0.16 (clipped: no gradient)
    # token 3: padding (garbage)
    # loss = 0.5 x (0.16 + 1.0 + 0.16) / 3 = 0.22;  vf_clipfrac = 1/3
    values = torch.tensor([[1.1, 2.0, 0.5, 1e9]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, float("nan")]])
    returns = torch.tensor([[1.5, 1.0, 0.4, 3.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.22)
    assert metrics["vf_clipfrac"].item() == pytest.approx(1 / 3)
    loss.backward()
    # d/dv of 0.5 (v - R)^2 / 3 = (v - R) / 3: token 0 -> -0.4/3, token 1 -> 1/3, token 2 clipped -> 0, padding 0
    assert values.grad[0].tolist() == pytest.approx([-0.4 / 3, 1 / 3, 0.0, 0.0])


def test_value_loss_without_clip():
    # 0.5 x ((2 - 1)^2 + (0.5 - 0.4)^2) / 2 = 0.2525
    loss, metrics = value_loss(torch.tensor([[2.0, 0.5]]), torch.tensor([[1.0, 1.0]]), torch.tensor([[1.0, 0.4]]),
                               torch.ones(1, 2), clip=None)
    assert loss.item() == pytest.approx(0.2525) and metrics["vf_clipfrac"].item() == 0.0


def test_value_loss_global_normaliser_makes_micro_batches_sum_to_the_full_batch():
    # Rows of 3 and 1 valid tokens. Full batch: 0.5 x (0.16 + 1.0 + 0.16 + 0.25) / 4 = 0.19625.
    # Micro-batches divided by the global count 4: 0.5 x 1.32 / 4 = 0.165 and 0.5 x 0.25 / 4 = 0.03125, sum 0.19625
    # (a per-call masked mean would give 0.22 + 0.125 = 0.345).
    values = torch.tensor([[1.1, 2.0, 0.5], [0.5, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.0, 0.0]])
    returns = torch.tensor([[1.5, 1.0, 0.4], [1.0, 0.0, 0.0]])  # row 1: v 0.5, R 1.0, v_old 0.5: clip 0.2 ->
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])     # clipped v 0.7, (0.3)^2 = 0.09 < 0.25: unclipped
    full, _ = value_loss(values, old, returns, mask, clip=0.2)
    assert full.item() == pytest.approx(0.19625)
    parts = [value_loss(values[i : i + 1], old[i : i + 1], returns[i : i + 1], mask[i : i + 1], clip=0.2,
                        num_tokens=4.0)[0] for i in range(2)]
    assert [p.item() for p in parts] == pytest.approx([0.165, 0.03125])
    (g_full,) = torch.autograd.grad(full, values)
    (g_parts,) = torch.autograd.grad(parts[0] + parts[1], values)
    torch.testing.assert_close(g_parts, g_full)


def test_value_loss_gradient_matches_finite_differences():
    torch.manual_seed(0)
    values = torch.randn(2, 5, dtype=torch.float64, requires_grad=True)
    old = values.detach() + 0.05 * torch.randn(2, 5, dtype=torch.float64)  # mostly inside the clip range
    returns = torch.randn(2, 5, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda v: value_loss(v, old, returns, mask, clip=0.5, num_tokens=8.0)[0],
                                    (values,))


def test_explained_variance_by_hand():
    # valid R = [1, 2, 3] (Var 2/3), V = [1, 2, 2]: R - V = [0, 0, 1], Var = 2/9; EV = 1 - (2/9) / (2/3) = 2/3.
    # The padding (garbage) is ignored.
    returns = torch.tensor([[1.0, 2.0, 99.0], [3.0, -5.0, 0.0]])
    values = torch.tensor([[1.0, 2.0, 7.0], [2.0, 1e6, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert explained_variance(values, returns, mask).item() == pytest.approx(2 / 3)
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    # Values that do not vary explain nothing: EV 0.
    assert explained_variance(torch.full((2, 3), 5.0), returns, mask).item() == pytest.approx(0.0)
    assert torch.isnan(explained_variance(values, torch.ones(2, 3), mask))
