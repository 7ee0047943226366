"""Clipped value loss worked by hand."""

import pytest
import torch

from distrl.algo import value_loss


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
