"""A mixture-of-experts policy in the learner (plain class, no Ray): the router figures of an update are those of
the routers' logits in transformers' own forward pass, and `learner.router_aux_loss_coef` adds exactly
transformers' load-balancing loss, whose gradient reaches the routers; a dense policy logs no router figures."""

from dataclasses import replace

import pytest
import torch

from distrl.algo.router import expert_load, max_violation, router_entropy
from distrl.config import LearnerConfig
from distrl.merging import values
from distrl.types.batches import Sequences, TrainBatch
from distrl.workers.training.packing import host_layout
from distrl.workers.training.trainer import Counts
from tests.test_learner import make_learner

B, P, T = 4, 4, 6


def unpadded_batch() -> TrainBatch:
    """Rows of one length (no padding): transformers' padded forward then routes exactly the learner's tokens."""
    ids = torch.randint(3, 200, (B, P + T), generator=torch.Generator().manual_seed(0))
    seqs = Sequences(input_ids=ids, attention_mask=torch.ones(B, P + T, dtype=torch.long),
                     response_mask=torch.ones(B, T), rollout_logprobs=torch.zeros(B, T),
                     policy_version=torch.zeros(B, dtype=torch.long),
                     response_versions=torch.zeros(B, T, dtype=torch.long))
    adv = torch.linspace(-1, 1, B)[:, None].expand(B, T).contiguous()
    return TrainBatch(seqs, old_logprobs=torch.zeros(B, T), advantages=adv, ref_logprobs=None)


def transformers_routing(model, data: TrainBatch):
    """transformers' router logits `[L, B (P + T), E]` and load-balancing loss of `data` (no mask: no padding)."""
    out = model(input_ids=data.sequences.input_ids, output_router_logits=True)
    return torch.stack(out.router_logits), out.aux_loss


def test_router_figures_are_those_of_transformers_own_routing(tiny_qwen3_moe_dir):
    learner = make_learner(tiny_qwen3_moe_dir)
    data = unpadded_batch()
    with torch.no_grad():
        logits, aux = transformers_routing(learner.model, data)
    figures = values(learner.update(data))  # one micro-batch; the figures are of the weights before the step
    violation = max_violation(expert_load(logits, 2))
    assert figures["moe/max_vio/max"] == pytest.approx(violation.max().item(), abs=1e-6)
    assert figures["moe/max_vio/mean"] == pytest.approx(violation.mean().item(), abs=1e-6)
    assert figures["moe/router_entropy"] == pytest.approx(router_entropy(logits).mean().item(), rel=1e-5)
    assert figures["moe/aux_loss"] == pytest.approx(aux.item(), rel=1e-5)
    assert 0 < figures["moe/max_vio/max"] < 8 / 2 - 1  # MaxVio's bound: E / k - 1
    assert "loss/router_aux" not in figures  # the coefficient is 0 by default


def test_the_load_balancing_term_is_transformers_loss_and_trains_the_routers(tiny_qwen3_moe_dir):
    data = unpadded_batch()
    micro, counts = data, Counts(num_tokens=float(B * T), num_seqs=float(B))
    grads = {}
    for coef in (0.0, 0.5):
        learner = make_learner(tiny_qwen3_moe_dir, router_aux_loss_coef=coef)
        loss, figures = learner._policy_loss(learner.model, micro, counts, host_layout(micro.sequences))
        loss.backward()
        grads[coef] = {n: p.grad.clone() for n, p in learner.model.named_parameters() if n.endswith("mlp.gate.weight")}
    learner.model.zero_grad()
    _, aux = transformers_routing(learner.model, data)
    assert figures["loss/router_aux"][0].item() == pytest.approx(0.5 * aux.item(), rel=1e-5)  # share: the whole batch
    (0.5 * aux).backward()
    for name, grad in grads[0.5].items():  # the term's gradient on each router is transformers' loss's
        expected = dict(learner.model.named_parameters())[name].grad
        assert torch.allclose(grad - grads[0.0][name], expected, atol=1e-6), name
        assert expected.abs().max() > 0


def test_a_dense_policy_logs_no_router_figures(tiny_model_dir):
    figures = values(make_learner(tiny_model_dir).update(unpadded_batch()))
    assert not [key for key in figures if key.startswith("moe/")]


def test_the_critic_takes_no_load_balancing_loss():
    from distrl.config import CriticConfig

    assert LearnerConfig(router_aux_loss_coef=1e-3).router_aux_loss_coef == 1e-3
    with pytest.raises(ValueError, match=r"critic\.router_aux_loss_coef"):
        CriticConfig(router_aux_loss_coef=1e-3)


def test_lora_adapts_a_moe_policys_attention_and_its_experts_only_served_merged(tiny_qwen3_moe_dir):
    from distrl.config import LoraConfig
    from tests.test_routing_replay import with_routes

    attention = LoraConfig(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    learner = make_learner(tiny_qwen3_moe_dir, lora=attention)
    trained = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 4 * 2 and all("lora_" in n and "self_attn" in n for n in trained)  # A, B x 4 x 2 layers
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters()}
    data = unpadded_batch()
    routed = with_routes(learner.model, data.sequences)  # replay reaches the routers under peft's wrappers
    figures = values(learner.update(replace(data, sequences=routed)))
    after = dict(learner.model.named_parameters())
    assert all(not torch.equal(after[n], before[n]) for n in trained if "lora_B" in n)  # B moves off zero
    assert all(torch.equal(after[n], before[n]) for n in before if n not in trained)  # routers and experts frozen
    assert figures["moe/max_vio/max"] > 0
    with pytest.raises(ValueError, match=r"target_modules \['gate_proj', 'up_proj', 'down_proj'\] on a mixture of "
                                         r"experts adapt its experts' fused parameters .* set learner.lora.serve "
                                         r"'merged'"):
        make_learner(tiny_qwen3_moe_dir, lora=LoraConfig())
