"""Rollout routing replay on the learner's side: a packed forward pass that replays the routes the model itself
chose gives exactly its log-probs and gradients; one given other routes uses exactly those experts, weighted by the
current routers' softmax over them, and the routers still receive gradients. The same through the batch
(`Sequences.routes`): the learner's old log-probs, its update (gradient checkpointing's recomputed forward too) and
the reference replay the routes a batch carries, and route tokens without one as the routers choose."""

from dataclasses import replace

import pytest
import torch

from distrl.algo.router import replayed_weights
from distrl.config import ModelConfig, ReferenceConfig
from distrl.types.batches import Sequences
from distrl.workers.training import moe
from distrl.workers.training.model import load_causal_lm, response_logprobs
from distrl.workers.training.packing import host_layout
from distrl.workers.training.reference import ReferenceWorker
from distrl.workers.training.trainer import Counts
from tests.test_learner import batch, make_learner, weights


def recorded(model, module_class, index: int):
    """Hooks keeping output `index` of every `module_class` module's forward (or its input `index`, negative)."""
    kept: list[torch.Tensor] = []

    def keep(module, args, output):
        kept.append(output[index] if index >= 0 else args[-index])

    return kept, [m.register_forward_hook(keep) for m in model.modules() if isinstance(m, module_class)]


def forward(model, layout, routes=None):
    """The response log-probs of `batch()` and every parameter's gradient of their sum, replaying `routes` `[L, N, k]`
    if any (the layout's, every token's given)."""
    model.zero_grad()
    if routes is not None:
        layout = replace(layout, routes=routes.transpose(0, 1))
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
    for used_weights, layer_logits, layer_routes in zip(used, logits, given, strict=True):  # norm_topk_prob False
        assert torch.allclose(used_weights, replayed_weights(layer_logits, layer_routes, renormalize=False))
    assert (replayed - plain).abs().max() > 1e-3  # other experts, other log-probs
    assert all(grads[f"model.layers.{i}.mlp.gate.weight"].abs().max() > 0 for i in range(2))


def test_routes_of_another_depth_are_refused(tiny_qwen3_moe_dir):
    model = load_causal_lm(ModelConfig(path=str(tiny_qwen3_moe_dir)), "float32")
    with pytest.raises(ValueError, match="routes of 3 layers for a model with 2 routers"):
        moe.route(model, torch.zeros(4, 3, 2, dtype=torch.long))


# ---------------------------------------------------------------------------------------- through the batch
def with_routes(model, seqs: Sequences) -> Sequences:
    """`seqs` carrying the routes the model itself chose for every real token (recorded from its own forward pass
    over the batch, in the packed row's order: the real tokens row after row), as an engine returns them."""
    kept, handles = recorded(model, moe._recorder(model).target_class, 2)
    with torch.no_grad():
        response_logprobs(model, seqs, 1.0)
    for handle in handles:
        handle.remove()
    real = seqs.attention_mask.bool()
    packed = torch.stack(kept, 1)  # [N, L, k]
    routes = torch.zeros(*real.shape, *packed.shape[1:], dtype=torch.uint8)
    routes[real] = packed.to(torch.uint8)
    return replace(seqs, routes=routes, routed=real.clone())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_a_batch_of_the_models_own_routes_scores_and_trains_exactly_as_one_without(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    replaying, plain = make_learner(model_dir), make_learner(model_dir)
    data = batch()
    routed = with_routes(plain.model, data.sequences)
    assert torch.equal(replaying.logprobs(routed), plain.logprobs(data.sequences))  # the old log-probs' pass
    reference = ReferenceWorker(ReferenceConfig(dtype="float32"), ModelConfig(path=str(model_dir)), temperature=1.0)
    assert torch.equal(reference.logprobs(routed), reference.logprobs(data.sequences))
    replaying.update(replace(data, sequences=routed))
    plain.update(data)
    after, expected = weights(replaying), weights(plain)
    assert all(torch.equal(after[name], expected[name]) for name in expected)


def test_a_batch_replays_exactly_its_routes_and_its_routers_learn(tiny_qwen3_moe_dir):
    learner = make_learner(tiny_qwen3_moe_dir)
    model, data = learner.model, batch()
    own = with_routes(model, data.sequences)
    chosen = torch.zeros(*own.routes.shape[:-1], 8).scatter_(-1, own.routes.long(), 1.0)
    other = (chosen * 100 + torch.arange(8.0)).topk(2, largest=False).indices.to(torch.uint8)  # 2 experts not chosen
    routed = own.routed.clone()
    routed[0] = False  # a sample the engine gave no routes
    routed[torch.arange(8), own.attention_mask.cumsum(-1).argmax(-1)] = False  # nor a sample's last token
    given = replace(own, routes=other, routed=routed)

    experts, handles = recorded(model, type(model.model.layers[0].mlp.experts), -1)  # (hidden, top_k_index, ...)
    replayed = learner.logprobs(given)  # the batch is one micro-batch: its packed row is the real tokens in order
    for handle in handles:
        handle.remove()
    real = own.attention_mask.bool()
    for layer, used in enumerate(experts):
        expected = torch.where(routed[real][:, None], other[real][:, layer].long(), own.routes[real][:, layer].long())
        assert torch.equal(used, expected), layer  # the given experts where routed, the router's own elsewhere
    plain = learner.logprobs(data.sequences)
    assert torch.equal(replayed[0], plain[0])  # the sample without routes: as without replay
    assert (replayed[1:] - plain[1:]).abs().max() > 1e-3

    micro = replace(data, sequences=given)
    loss, _ = learner._policy_loss(model, micro, Counts(num_tokens=float(data.response_mask.sum()), num_seqs=8.0),
                                   host_layout(given))
    loss.backward()
    assert all(model.model.layers[i].mlp.gate.weight.grad.abs().max() > 0 for i in range(2))  # through the weights


def test_replay_holds_in_the_forward_that_gradient_checkpointing_recomputes(tiny_qwen3_moe_dir):
    data = batch()
    plain = make_learner(tiny_qwen3_moe_dir)
    own = with_routes(plain.model, data.sequences)
    given = replace(own, routes=own.routes.flip(-1).roll(1, dims=-2))  # the next layer's experts: other routes
    moved = {}
    for checkpointing in (False, True):
        learner = make_learner(tiny_qwen3_moe_dir, gradient_checkpointing=checkpointing)
        learner.update(replace(data, sequences=given))
        moved[checkpointing] = weights(learner)
    # Recomputed without the routes, the backward pass would route by the routers again: other gradients.
    assert all(torch.allclose(moved[True][n], moved[False][n], atol=1e-6) for n in moved[False])
    plain.update(data)
    assert any((moved[True][n] - w).abs().max() > 1e-4 for n, w in weights(plain).items())


def test_a_run_replays_the_routes_its_engine_returned_and_splits_the_mismatch(tmp_path, tiny_qwen3_moe_dir):
    from distrl.driver import train
    from tests.routing_rollout import RoutingHFRolloutWorker
    from tests.test_driver_local import local_config

    cfg = local_config(tmp_path, tiny_qwen3_moe_dir, "rollout.dtype=float32", "run.steps=2")
    history = train(cfg, rollout_worker=RoutingHFRolloutWorker)
    assert [h["policy_version"] for h in history] == [0, 1]
    # The engine's routes are the model's own, in float32 on both sides: replayed in the learners' old log-probs at
    # the columns of their tokens (misplaced, they would route tokens elsewhere: other log-probs), the sampler's
    # log-probs are the learners', with the routes and without.
    for h in history:
        assert abs(h["correction/mismatch_kl/replayed"]) < 1e-5 and abs(h["correction/mismatch_kl/unreplayed"]) < 1e-5
        assert h["correction/mismatch_k3/replayed"] < 1e-5 and "moe/max_vio/max" in h
