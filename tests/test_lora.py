"""LoRA on the learner (`learner.lora`, plain classes, no Ray): the config refuses what cannot work, naming the field;
peft's adapters give the loss and the gradients of a low-rank model written by hand; only the adapters train; the
reference is the base model; a push exports only the adapters, fingerprinted as vLLM holds them; checkpoints keep
them in PEFT's format and resume exactly."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

from distrl import checkpoint
from distrl.batching import select_by_covariance
from distrl.config import LearnerConfig, LoraConfig, LossConfig, ModelConfig, from_dict
from distrl.workers.training import lora
from distrl.workers.training.learner import Learner
from distrl.workers.training.model import load_causal_lm, response_logprobs
from distrl.workers.weights import fingerprint
from tests.test_learner import OTHER_LOSSES, batch, ragged_batch, save, scored, sgd, update

LORA = {"rank": 8, "alpha": 32.0, "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj"]}


def make_lora_learner(model_dir, loss: LossConfig | None = None, **learner) -> Learner:
    cfg = LearnerConfig(**{"lr": 1e-2, "micro_batch_size": 4, "max_grad_norm": None, "lora": LORA, **learner})
    return Learner(ModelConfig(path=str(model_dir)), cfg, loss or LossConfig(), temperature=1.0, norm_len=6,
                   mini_batch_size=8, total_optimizer_steps=10, seed=0)


def randomize_b(model: torch.nn.Module, seed: int = 1) -> None:
    """B starts at zero (the first policy is the base): give it values, so that B A moves the outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.1)


# ------------------------------------------------------------------------------------------------------------ config
def config(**learner) -> dict:
    return {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "reward": {"function": "distrl.tasks.toy:reward"},
            "learner": {"lora": dict(LORA), **learner}}


@pytest.mark.parametrize(("tree", "message"), [
    ({"lora": {"rank": 4}}, "learner.lora.rank 4 is not a rank vLLM serves"),
    ({"lora": {"target_modules": ["q_proj", "embed_tokens"]}}, "learner.lora.target_modules ['embed_tokens']"),
    ({"lora": {"target_modules": ["q_proj", "q_proj"]}}, "names a module twice"),
    ({"lora": {"dropout": 1.0}}, "dropout"),
    ({"strategy": {"type": "fsdp", "cpu_offload": True}}, "learner.lora with learner.strategy.cpu_offload"),
])
def test_the_config_refuses_what_vllm_cannot_serve_naming_the_field(tree, message):
    with pytest.raises(Exception, match=re.escape(message)):
        from_dict(config(**tree))


def test_the_config_refuses_incompatible_sections_with_the_reason():
    with pytest.raises(Exception, match=re.escape("learner.lora with cluster.weight_sync 'nccl'")):
        from_dict({**config(), "cluster": {"weight_sync": "nccl"}})
    with pytest.raises(Exception, match=re.escape("learner.lora with reference.path")):
        from_dict({**config(), "loss": {"kl": {"coef": 0.01}}, "reference": {"path": "other"}})
    with pytest.raises(Exception, match=re.escape("critic.lora")):
        from_dict({**config(), "algorithm": {"advantage": "gae"}, "critic": {"lora": {}}})


def test_with_lora_the_kl_reference_needs_no_actor():
    cfg = from_dict({**config(), "loss": {"kl": {"coef": 0.01}}})
    assert cfg.needs_ref_logprobs and not cfg.needs_reference
    assert from_dict({**config(), "learner": {}, "loss": {"kl": {"coef": 0.01}}}).needs_reference
    assert LoraConfig(rank=16, alpha=8).scaling == 0.5


# -------------------------------------------------------------------------------------------------------- gradients
class HandLoRA(torch.nn.Module):
    """y = W x + (alpha / r) B (A x), written out: W frozen, A `[r, in]` and B `[out, r]` trained."""

    def __init__(self, base: torch.nn.Linear, a: torch.Tensor, b: torch.Tensor, scaling: float):
        super().__init__()
        self.weight = torch.nn.Parameter(base.weight.detach().clone(), requires_grad=False)
        self.a, self.b = torch.nn.Parameter(a.clone()), torch.nn.Parameter(b.clone())
        self.scaling = scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.scaling * ((x @ self.a.T) @ self.b.T)


def test_peft_adapters_give_the_loss_and_gradients_of_a_hand_built_low_rank_model(tiny_model_dir):
    cfg = LoraConfig(**LORA)
    torch.manual_seed(0)
    peft_model = lora.wrap(load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32"), cfg)
    randomize_b(peft_model)
    hand = load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32")
    for p in hand.parameters():
        p.requires_grad_(False)
    adapters = dict(lora.adapter_tensors(peft_model))
    replaced = {}
    for name, module in list(hand.named_modules()):
        if name.rpartition(".")[2] in cfg.target_modules:
            key = f"base_model.model.{name}"
            hand_layer = HandLoRA(module, adapters[f"{key}.lora_A.weight"], adapters[f"{key}.lora_B.weight"],
                                  cfg.scaling)
            parent = hand.get_submodule(name.rpartition(".")[0])
            setattr(parent, name.rpartition(".")[2], hand_layer)
            replaced[key] = hand_layer
    assert len(replaced) == 4 * 2  # 4 modules x 2 layers

    data = batch().sequences
    weights = torch.linspace(-1, 1, data.response_mask.numel()).view_as(data.response_mask)
    loss_peft = (response_logprobs(peft_model, data, 1.0)[0] * weights * data.response_mask).sum()
    loss_hand = (response_logprobs(hand, data, 1.0)[0] * weights * data.response_mask).sum()
    loss_peft.backward()
    loss_hand.backward()
    assert torch.allclose(loss_peft, loss_hand, atol=1e-5, rtol=0)
    grads = {n: p.grad for n, p in peft_model.named_parameters() if p.grad is not None}
    assert len(grads) == 2 * len(replaced)  # only A and B get gradients
    for key, layer in replaced.items():
        g_a = grads[f"{key}.lora_A.default.weight"]
        g_b = grads[f"{key}.lora_B.default.weight"]
        assert layer.a.grad.abs().max() > 0 and layer.b.grad.abs().max() > 0
        assert torch.allclose(g_a, layer.a.grad, atol=1e-6, rtol=1e-4), key
        assert torch.allclose(g_b, layer.b.grad, atol=1e-6, rtol=1e-4), key


# ---------------------------------------------------------------------------------------------------------- learner
def test_only_the_adapters_train_and_the_reference_is_the_base_model(tiny_model_dir):
    learner = make_lora_learner(tiny_model_dir)
    base = load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32")
    trained = {n for n, p in learner.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    frozen = {n: p.detach().clone() for n, p in learner.model.named_parameters() if not p.requires_grad}
    data = batch()
    before = learner.logprobs(data.sequences)
    ref_before = learner.ref_logprobs(data.sequences)
    for _ in range(2):
        update(learner, scored(learner, data))
    after = learner.logprobs(data.sequences)
    assert (after - before).abs().max() > 1e-3  # the policy moved
    assert all(torch.equal(p, frozen[n]) for n, p in learner.model.named_parameters() if not p.requires_grad)
    from distrl.workers.training.model import score_in_micro_batches

    expected = score_in_micro_batches(base, data.sequences, 1.0, 8)
    assert torch.allclose(learner.ref_logprobs(data.sequences), expected, atol=1e-6)
    assert torch.allclose(ref_before, expected, atol=1e-6)  # B = 0 at the start: policy = base
    assert torch.allclose(before, expected, atol=1e-6)


@pytest.mark.parametrize("policy", OTHER_LOSSES, ids=[p.type for p in OTHER_LOSSES])
def test_every_loss_trains_the_adapters_alike_in_micro_batches(tiny_model_dir, policy):
    # With each loss, only the adapters move, and micro-batches of 2 rows move them as one pass of 8 rows does
    # (a stale batch, old log-probs moved by +-0.05, so that ratios leave 1; the covariance losses' tokens selected
    # over the whole batch).
    learners = [sgd(make_lora_learner(tiny_model_dir, LossConfig(policy=policy), micro_batch_size=size))
                for size in (8, 2)]
    for learner in learners:
        randomize_b(learner.model)  # B = 0 would give A no gradient
    frozen = {n: p.detach().clone() for n, p in learners[0].model.named_parameters() if not p.requires_grad}
    data = scored(learners[0], ragged_batch())
    shift = 0.05 * torch.where(torch.arange(8) % 2 == 0, 1.0, -1.0) * data.response_mask
    data = replace(data, old_logprobs=data.old_logprobs + shift)
    if policy.type in ("clip_cov", "kl_cov"):
        data = replace(data, cov_selected=select_by_covariance(data.old_logprobs, data.advantages,
                                                               data.response_mask, policy, 1, seed=0))
    figures = [update(learner, data) for learner in learners]
    assert figures[1]["loss/policy"] == pytest.approx(figures[0]["loss/policy"], rel=1e-5, abs=1e-7)
    adapters = [{n: p.detach() for n, p in learner.model.named_parameters() if p.requires_grad}
                for learner in learners]
    assert adapters[0].keys() and all("lora_" in n for n in adapters[0])
    for name, value in adapters[0].items():
        torch.testing.assert_close(adapters[1][name], value, rtol=1e-4, atol=1e-6, msg=name)
    assert all(torch.equal(p, frozen[n]) for n, p in learners[0].model.named_parameters() if not p.requires_grad)


def test_the_export_is_the_adapters_and_their_fingerprint_is_what_vllm_holds(tiny_model_dir):
    learner = make_lora_learner(tiny_model_dir)
    randomize_b(learner.model)
    specs = learner.weight_specs(2**20, "float32")
    names = [name for spec in specs for name, _ in spec]
    assert names and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in names)
    assert all(n.startswith("base_model.model.model.layers.") for n in names)
    bucket = learner.weight_bucket(specs[0], "float32")
    adapters = dict(lora.adapter_tensors(learner.model))
    assert all(torch.equal(t, adapters[n]) for n, t in bucket.items())
    expected = learner.weights_fingerprint("float32")
    assert set(expected) == set(names)
    scale = LoraConfig(**LORA).scaling  # 4: B as vLLM holds it is 4 B
    b_name = next(n for n in names if ".lora_B." in n)
    assert expected[b_name] == fingerprint.of_sample(fingerprint.sample(adapters[b_name] * scale))
    a_name = next(n for n in names if ".lora_A." in n)
    assert expected[a_name] == fingerprint.of_sample(fingerprint.sample(adapters[a_name]))


def test_a_checkpoint_holds_the_adapters_in_peft_format_and_resumes_exactly(tiny_model_dir, tmp_path):
    learner = make_lora_learner(tiny_model_dir)
    data = batch()
    update(learner, scored(learner, data))
    path = save(learner, tmp_path / "step_000001", 1)
    adapter = path / "policy" / lora.ADAPTER_DIR
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    assert not (path / "policy" / "model").exists()
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["r"] == 8 and saved["lora_alpha"] == 32.0 and sorted(saved["target_modules"]) == sorted(
        LORA["target_modules"])
    from peft import PeftModel

    reread = PeftModel.from_pretrained(load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32"), adapter)
    from distrl.workers.training.model import score_in_micro_batches

    assert torch.allclose(score_in_micro_batches(reread, data.sequences, 1.0, 8),
                          learner.logprobs(data.sequences), atol=1e-6)

    resumed = make_lora_learner(tiny_model_dir)
    resumed.load_checkpoint(str(path / "policy"), 1)
    follow = replace(data, advantages=-data.advantages)
    a, b = update(learner, scored(learner, follow)), update(resumed, scored(resumed, follow))
    assert a["loss/policy"] == b["loss/policy"] and a["learner/grad_norm"] == b["learner/grad_norm"]
    assert all(torch.equal(x, y) for (_, x), (_, y) in zip(lora.adapter_tensors(learner.model),
                                                           lora.adapter_tensors(resumed.model), strict=True))

    full = Learner(ModelConfig(path=str(tiny_model_dir)), LearnerConfig(micro_batch_size=4), LossConfig(),
                   temperature=1.0, norm_len=6, mini_batch_size=8, total_optimizer_steps=10, seed=0)
    with pytest.raises(RuntimeError, match="holds adapters"):
        full.load_checkpoint(str(path / "policy"), 1)
    assert checkpoint.problem(path, True) is None


def test_gradient_checkpointing_gives_the_adapters_the_same_gradients(tiny_model_dir):
    data = batch()
    figures = []
    for checkpointing in (False, True):
        learner = make_lora_learner(tiny_model_dir, gradient_checkpointing=checkpointing)
        randomize_b(learner.model)
        figures.append(update(learner, scored(learner, data)))
    assert figures[0]["learner/grad_norm"] > 0
    assert figures[0]["learner/grad_norm"] == pytest.approx(figures[1]["learner/grad_norm"], rel=1e-5)


def test_export_merge_writes_an_hf_model_that_scores_as_the_adapted_policy(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from distrl.cli import main
    from distrl.workers.training.model import score_in_micro_batches

    learner = make_lora_learner(tiny_model_dir)
    data = batch()
    update(learner, scored(learner, data))
    path = save(learner, tmp_path / "step_000001", 1)
    args = ["export", "--config", "configs/grpo-lora.yaml", "--set", f"model.path={tiny_model_dir}",
            "--set", "model.create_tiny_if_missing=false", "--checkpoint", str(path)]
    assert main([*args, "--output", str(tmp_path / "plain")]) == 2
    assert "add --merge" in capsys.readouterr().err
    assert main([*args, "--merge", "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")  # plain transformers, no peft
    assert AutoTokenizer.from_pretrained(tmp_path / "merged").vocab_size > 0
    base = load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32")
    merged_packed = load_causal_lm(ModelConfig(path=str(tmp_path / "merged")), "float32")
    mine = learner.logprobs(data.sequences)
    assert torch.allclose(score_in_micro_batches(merged_packed, data.sequences, 1.0, 8), mine, atol=1e-5)
    assert not torch.allclose(score_in_micro_batches(base, data.sequences, 1.0, 8), mine, atol=1e-3)
    assert not any("lora" in name for name in merged.state_dict())
    assert main([*args, "--merge", "--output", str(tmp_path / "merged")]) == 2  # never over an existing model


def test_distrl_eval_points_a_lora_checkpoint_at_export_merge(tiny_model_dir, tmp_path):
    from distrl.eval_command import EvalError, model_to_evaluate

    learner = make_lora_learner(tiny_model_dir)
    path = save(learner, tmp_path / "step_000001", 1)
    cfg = from_dict({**config(), "model": {"path": str(tiny_model_dir)}})
    with pytest.raises(EvalError, match=re.escape("holds LoRA adapters (policy/adapter): merge them")):
        model_to_evaluate(cfg, str(path), None)
