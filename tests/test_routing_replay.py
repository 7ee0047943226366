"""Rollout routing replay on the learner's side: a packed forward pass that replays the routes the model itself
chose gives exactly its log-probs and gradients; one given other routes uses exactly those experts, weighted by the
current routers' softmax over them, and the routers still receive gradients."""

import pytest
import torch

from distrl.algo.router import replayed_weights
from distrl.config import ModelConfig
from distrl.workers.training import moe
from distrl.workers.training.model import load_causal_lm, response_logprobs
from distrl.workers.training.packing import host_layout
from tests.test_learner import batch


def recorded(model, module_class, index: int):
    """Hooks keeping output `index` of every `module_class` module's forward (or its input `index`, negative)."""
    kept: list[torch.Tensor] = []

    def keep(module, args, output):
        kept.append(output[index] if index >= 0 else args[-index])

    return kept, [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, module_class)]


def forward(model, layout, routes=None):
    """The response log-probs of `batch()` and every parameter's gradient of their sum, replaying `routes` if any."""
    model.zero_grad()
    if routes is None:
        logprobs, _ = response_logprobs(model, batch().sequences, 1.0, layout=layout)
    else:
        with moe.replayed_routes(model, routes):
            logprobs, _ = response_logprobs(model, batch().sequences, 1.0, layout=layout)
    logprobs.sum().backward()
    return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_replaying_the_models_own_routes_changes_nothing(arch, request):
    model = load_causal_lm(ModelConfig(path=str(request.getfixturevalue(f"tiny_{arch}_dir"))), "float32")
    layout = host_layout(batch().sequences)
    router = moe._recorder(model).target_class
    routes, handles = recorded(model, router, 2)  # (logits, weights, indices): the experts it chose
    plain, plain_grads = forward(model, layout)
    for handle in handles:
        handle.remove()
    replayed, replayed_grads = forward(model, layout, torch.stack(routes).clone())  # [L, N, k]
    assert torch.equal(replayed, plain)
    assert replayed_grads.keys() == plain_grads.keys()
    assert all(torch.equal(replayed_grads[n], plain_grads[n]) for n in plain_grads)
    assert any(n.endswith("mlp.gate.weight") for n in plain_grads)  # the routers are trained either way


def test_replayed_routes_are_the_experts_used_weighted_by_the_current_router(tiny_qwen3_moe_dir):
    model = load_causal_lm(ModelConfig(path=str(tiny_qwen3_moe_dir)), "float32")
    layout = host_layout(batch().sequences)
    router = moe._recorder(model).target_class
    routes, handles = recorded(model, router, 2)
    plain, _ = forward(model, layout)
    for handle in handles:
        handle.remove()
    own = torch.stack(routes)
    chosen_before = torch.zeros(*own.shape[:2], 8).scatter_(-1, own, 1.0)
    given = (chosen_before * 100 + torch.arange(8.0)).topk(2, largest=False).indices  # the 2 first experts not chosen
    assert not (given[..., None] == own[..., None, :]).any()

    experts_class = type(model.model.layers[0].mlp.experts)
    chosen, handles = recorded(model, experts_class, -1)  # the experts' inputs: (hidden, top_k_index, top_k_weights)
    used, more = recorded(model, experts_class, -2)
    logits, logit_handles = recorded(model, router, 0)
    replayed, grads = forward(model, layout, given)
    for handle in (*handles, *more, *logit_handles):
        handle.remove()
    assert all(torch.equal(c, g) for c, g in zip(chosen, given, strict=True))  # exactly the given experts
    for weights, layer_logits, layer_routes in zip(used, logits, given, strict=True):  # norm_topk_prob False
        assert torch.allclose(weights, replayed_weights(layer_logits, layer_routes, renormalize=False))
    assert (replayed - plain).abs().max() > 1e-3  # other experts, other log-probs
    assert all(grads[f"model.layers.{i}.mlp.gate.weight"].abs().max() > 0 for i in range(2))


def test_routes_of_another_depth_are_refused(tiny_qwen3_moe_dir):
    model = load_causal_lm(ModelConfig(path=str(tiny_qwen3_moe_dir)), "float32")
    with pytest.raises(ValueError, match="routes of 3 layers for a model with 2 routers"), \
            moe.replayed_routes(model, torch.zeros(3, 4, 2, dtype=torch.long)):
        pass
