"""The routers' figures and load-balancing loss, hand-worked, and the loss against transformers' own."""

import math

import pytest
import torch

from distrl.algo.router import expert_load, load_balancing_loss, max_violation, replayed_weights, router_entropy


def test_expert_load_counts_each_tokens_top_k_and_maxvio_compares_the_largest_with_uniform():
    # Token 0 picks experts {0, 1}, token 1 picks {1, 2}: of the 4 slots, expert 1 took 2, experts 0 and 2 one each.
    logits = torch.tensor([[[3.0, 2.0, 1.0, 0.0], [0.0, 3.0, 2.0, 1.0]]])  # [L=1, N=2, E=4]
    load = expert_load(logits, top_k=2)
    assert load.tolist() == [[0.25, 0.5, 0.25, 0.0]]
    assert max_violation(load).tolist() == [1.0]  # 0.5 over the uniform 0.25, less 1
    assert max_violation(torch.full((3, 4), 0.25)).tolist() == [0.0, 0.0, 0.0]  # balanced layers


def test_router_entropy_is_each_layers_mean_over_tokens():
    # Layer 0: probabilities [1/4, 1/4, 1/2] on both tokens: 2 (1/4) ln 4 + (1/2) ln 2 = 1.5 ln 2. Layer 1: uniform
    # on one token (ln 3), certain on the other (0): mean ln 3 / 2.
    lay0 = torch.log(torch.tensor([1.0, 1.0, 2.0])).expand(2, 3)
    lay1 = torch.tensor([[0.0, 0.0, 0.0], [0.0, -1e4, -1e4]])
    got = router_entropy(torch.stack([lay0, lay1]))
    assert got.tolist() == pytest.approx([1.5 * math.log(2), math.log(3) / 2], abs=1e-6)


def test_load_balancing_loss_is_k_when_balanced_and_its_gradient_reaches_the_router_through_p():
    # E = 2, k = 1. Balanced: token 0 -> expert 0 (p = [3/4, 1/4]), token 1 -> expert 1: f = P = [1/2, 1/2],
    # 2 (1/4 + 1/4) = 1.
    ln3 = math.log(3.0)
    balanced = torch.tensor([[[ln3, 0.0], [0.0, ln3]]])
    assert load_balancing_loss(balanced, top_k=1).item() == pytest.approx(1.0)
    # Both tokens -> expert 0: f = [1, 0], P = [3/4, 1/4]: 2 (3/4) = 1.5. With f held, the loss is sum_n p_n0 (2 / N
    # = 1), and dp0/dz0 = p0 p1 = 3/16 per token: +3/16 on each token's expert-0 logit, -3/16 on its expert-1 one.
    skewed = torch.tensor([[[ln3, 0.0], [ln3, 0.0]]], requires_grad=True)
    loss = load_balancing_loss(skewed, top_k=1)
    assert loss.item() == pytest.approx(1.5)
    loss.backward()
    assert skewed.grad.flatten().tolist() == pytest.approx([3 / 16, -3 / 16, 3 / 16, -3 / 16])


def test_load_balancing_loss_is_transformers_own():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = torch.randn(3, 10, 8, generator=torch.Generator().manual_seed(0))  # 3 layers, 10 tokens, 8 experts
    theirs = load_balancing_loss_func(tuple(logits), num_experts=8, top_k=2)
    assert load_balancing_loss(logits, top_k=2).item() == pytest.approx(float(theirs), rel=1e-6)


def test_replayed_routes_are_weighted_by_the_current_routers_softmax_over_them():
    # Probabilities [0.1, 0.2, 0.3, 0.4]; the routes say experts 3 and 0: weights 0.4 and 0.1, renormalised 0.8 and
    # 0.2. The top 2 of this router would have been experts 3 and 2: replay keeps the routes it is given.
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]])).requires_grad_()
    routes = torch.tensor([[3, 0]])
    assert replayed_weights(logits, routes, renormalize=False).flatten().tolist() == pytest.approx([0.4, 0.1])
    weights = replayed_weights(logits, routes, renormalize=True)
    assert weights.flatten().tolist() == pytest.approx([0.8, 0.2])
    # d(w_3) / dz = w_3 (e_3 - w) over the two chosen experts: +0.16 on z_3, -0.16 on z_0, none on the others.
    weights[0, 0].backward()
    assert logits.grad.flatten().tolist() == pytest.approx([-0.16, 0.0, 0.0, 0.16], abs=1e-6)
