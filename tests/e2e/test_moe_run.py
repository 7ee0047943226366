"""A mixture-of-experts policy trains end to end: the quickstart with the tiny Qwen3-MoE (8 experts, top 2) as its
policy, reference and engine (vLLM's CPU build, float32), every push verified expert by expert. In this process
(cluster.backend local); then on the session's cluster with two FSDP learners (the expert stacks sharded by
expert), its checkpoint's HF copy loading in transformers, and its resume giving exactly the rows of a run never
interrupted."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from distrl import config
from distrl.driver import train

from .conftest import ROOT, outcome

SMALL = ("rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.sampling.max_new_tokens=8",
         "learner.micro_batch_size=16", "data.shuffle=false", "eval=null", "run.progress=false",
         "run.ray_metrics=false", "run.tensorboard=false")


def moe_config(tmp_path: Path, model_dir: Path, *overrides: str) -> config.Config:
    return config.load(ROOT / "configs" / "quickstart.yaml", [f"model.path={model_dir}",
                                                              f"run.output_dir={tmp_path}", *SMALL, *overrides])


def test_the_quickstart_trains_a_moe_policy_in_process(tmp_path, tiny_qwen3_moe_dir):
    cfg = moe_config(tmp_path, tiny_qwen3_moe_dir, "cluster.backend=local", "run.steps=3")
    assert cfg.cluster.verify_weights
    history = train(cfg)
    assert [h["policy_version"] for h in history] == [0, 1, 2]
    # float32 on both sides, the pushed experts and router verified: the sampler's log-probs are the learner's, as
    # with a dense model (tests/test_driver_local.py: below 1e-5).
    assert all(abs(h["correction/mismatch_kl/staleness_0"]) < 1e-5 for h in history)
    assert history[-1]["kl/ref"] > 0  # the policy moved away from the reference
    # The routers' figures, every step: MaxVio within its bounds (0 .. E / k - 1), entropy below log E.
    assert all(0 < h["moe/max_vio/mean"] <= h["moe/max_vio/max"] < 3 for h in history)
    assert all(0 < h["moe/router_entropy"] < 2.08 for h in history) and "loss/router_aux" not in history[-1]


def test_lora_on_a_moe_policys_attention_and_experts_served_merged_in_process(tmp_path, tiny_qwen3_moe_dir):
    """Adapters on every projection, the experts' fused parameters included (peft's target_parameters), served
    merged: vLLM's CPU build, which cannot serve LoRA on a MoE, starts without it and is pushed the adapted blocks
    merged, each push verified tensor by tensor."""
    cfg = moe_config(tmp_path, tiny_qwen3_moe_dir, "cluster.backend=local", "run.steps=3", "learner.lora.rank=8",
                     "learner.lora.serve=merged", "learner.lr=1e-2")
    assert cfg.learner.lora is not None and cfg.served_adapters is None and cfg.cluster.verify_weights
    assert not cfg.needs_reference  # the reference is the learner's base, the adapters disabled
    history = train(cfg)
    assert [h["policy_version"] for h in history] == [0, 1, 2]
    # float32 on both sides: the engine samples with the merged weights the learner computes with (its adapters
    # unmerged: W x + s B (A x), rounding apart), as close as a dense model's (tests/test_driver_local.py: 1e-5).
    assert all(abs(h["correction/mismatch_kl/staleness_0"]) < 1e-5 for h in history)
    assert history[-1]["kl/ref"] > 0  # the adapters moved the policy away from the base
    # Each push: both layers' attention (q 128x128, k and v 64x128, o 128x128, two norms of 32: 49216 floats) and
    # MLP (experts' gate_up_proj 8x128x128 and down_proj 8x128x64, router 8x128: 197632), float32; no embedding,
    # LM head or layer norm.
    assert all(h["sync/bytes"] == 4 * 2 * (49216 + 197632) for h in history)


def test_two_fsdp_learners_train_a_moe_policy_and_resume_it_exactly(ray_session, tmp_path, tiny_qwen3_moe_dir):
    fsdp = ("learner.strategy=fsdp", "cluster.learner.num_actors=2", "cluster.learner.num_cpus=0.25",
            "learner.micro_batch_size=8", "run.checkpoint_every=2")
    whole = moe_config(tmp_path / "whole", tiny_qwen3_moe_dir, *fsdp, "run.steps=3")
    history = train(whole)
    assert [h["policy_version"] for h in history] == [0, 1, 2]
    assert all(abs(h["correction/mismatch_kl/staleness_0"]) < 1e-5 for h in history)
    assert all(h["moe/max_vio/max"] > 0 for h in history)  # both learners' routers measured

    from transformers import AutoModelForCausalLM

    copy = tmp_path / "whole" / "quickstart" / "checkpoints" / "step_000002" / "policy" / "model"
    index = json.loads((copy / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in index  # save_pretrained's layout, which vLLM loads
    policy = AutoModelForCausalLM.from_pretrained(copy)
    start = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_dir)
    moved = policy.model.layers[1].mlp.experts.gate_up_proj - start.model.layers[1].mlp.experts.gate_up_proj
    assert moved.abs().amax(dim=(1, 2)).gt(0).any()  # the experts were trained and saved
    assert torch.isfinite(policy(input_ids=torch.tensor([[5, 17, 33]])).logits).all()

    cut = moe_config(tmp_path / "cut", tiny_qwen3_moe_dir, *fsdp, "run.steps=3", "run.checkpoint_at_end=false")
    train(cut)  # step 3 trained, not saved: the resume redoes it from step 2's shards
    train(moe_config(tmp_path / "cut", tiny_qwen3_moe_dir, *fsdp, "run.steps=3", "run.resume=true",
                     "run.overwrite=false"))
    assert outcome(tmp_path / "cut" / "quickstart" / "metrics.jsonl") == outcome(
        tmp_path / "whole" / "quickstart" / "metrics.jsonl")
