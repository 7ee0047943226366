"""LoRA runs for real (Ray actors, vLLM CPU engines serving the adapters, transformers + peft learners), from
configs/grpo-lora.yaml: the synchronous and asynchronous loops train with every push verified against the engine's
LoRA slot and no reference actor, checkpoints hold the adapters in PEFT's format, a synchronous run in hybrid
actors, resumed, gives exactly the rows of one with every role apart never interrupted, a resumed asynchronous one
with multi-turn episodes (pushes landing while turns are in flight) continues from its checkpoint's adapters, and
two sharded learners train as one replicated."""

from __future__ import annotations

import json
from pathlib import Path

from distrl import config
from distrl.driver import train

from .conftest import ROOT, outcome

SMALL = ("rollout.prompts_per_step=4", "learner.micro_batch_size=16", "data.shuffle=false")


def lora_config(tmp_path: Path, *overrides: str) -> config.Config:
    return config.load(ROOT / "configs" / "grpo-lora.yaml", [
        f"model.path={tmp_path.parent / 'tiny-model'}", f"run.output_dir={tmp_path}", "run.progress=false",
        "eval=null", *SMALL, *overrides])


def test_sync_lora_run_and_its_exact_resume_in_hybrid_actors(ray_session, tmp_path):
    """A run with every role apart, then the same run in hybrid actors, cut after an unsaved step and resumed, gives
    exactly its rows: in hybrid actors each push is the adapters alone, loaded into the actor's own engine and
    checked in its slot, and the resume brings back the adapters, the optimizer state and the data position.
    (The two halves need no run of their own: hybrid or apart, the samples, the learner and the reference are the
    same, and a run's start costs more than its steps.)"""
    whole = lora_config(tmp_path / "whole", "run.steps=4", "run.checkpoint_every=2")
    assert whole.learner.lora is not None and whole.cluster.verify_weights and not whole.needs_reference
    history = train(whole)
    assert [h["policy_version"] for h in history] == [0, 1, 2, 3]
    # vLLM samples with the learner's adapters: fp32 on both sides, so the sampler's log-probs are the learner's.
    assert all(abs(h["correction/mismatch_kl/staleness_0"]) < 1e-4 for h in history)
    assert history[-1]["kl/ref"] > 0 and "idle/reference" not in history[-1]
    assert all(h["sync/bytes"] == 188416 for h in history)  # the adapters (47104 floats), never the model
    policy = tmp_path / "whole" / "grpo-lora" / "checkpoints" / "step_000004" / "policy"
    assert json.loads((policy / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert not (policy / "model").exists()

    hybrid = ("cluster.colocate=hybrid", "run.checkpoint_every=2")
    cut = lora_config(tmp_path / "cut", *hybrid, "run.steps=3", "run.checkpoint_at_end=false")
    train(cut)  # step 3 trained, not saved: the resume redoes it from step 2's adapters and optimizer state
    resumed = lora_config(tmp_path / "cut", *hybrid, "run.steps=4", "run.resume=true", "run.overwrite=false")
    assert resumed.cluster.hybrid_mode
    assert all(h["sync/bytes"] == 188416 for h in train(resumed))
    rows = outcome(tmp_path / "cut" / "grpo-lora" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows == outcome(tmp_path / "whole" / "grpo-lora" / "metrics.jsonl")


def test_async_multi_turn_lora_run_within_the_bound_and_resumed(ray_session, tmp_path):
    """Episodes with an environment, 4 chunks per engine (the default with an env): pushes land while turns are in
    flight, each waits for them (a request keeps its adapters) and the later turns sample with the new ones; cut
    after an unsaved step and resumed, the run continues from its checkpoint's adapters."""
    common = ("loop.mode=async", "loop.max_staleness=1", "run.checkpoint_every=2", "rollout.sampling.max_new_tokens=6",
              "env.class=tests.agent_envs:Chatter", "env.kwargs.turns=2")
    train(lora_config(tmp_path, *common, "run.steps=3", "run.checkpoint_at_end=false"))  # step 3 trained, not saved
    resumed = train(lora_config(tmp_path, *common, "run.steps=4", "run.resume=true", "run.overwrite=false"))
    rows = outcome(tmp_path / "grpo-lora" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert resumed[0]["learner/optimizer_steps"] == 3  # step 2's adapters and optimizer state came back
    assert max(r["staleness/max"] for r in rows) <= 1
    # The samples of version v are scored with the adapters of v (mismatch ~0), older ones carry the real lag; after
    # the resume too, so the new engine serves the resumed adapters, not fresh ones.
    assert all(abs(r["correction/mismatch_kl/staleness_0"]) < 1e-4 for r in rows
               if "correction/mismatch_kl/staleness_0" in r)
    assert any("correction/mismatch_kl/staleness_0" in r for r in resumed)
    assert all(r["learner/tokens"] > 0 and r["kl/ref"] >= 0 for r in rows)
    assert all(r["agent/turns_mean"] == 2.0 and r["agent/retokenization_drift"] == 0.0 for r in rows)
    pushed = [r["sync/bytes"] for r in rows if r.get("sync/bytes") is not None]  # None: no push finished in it
    assert pushed and set(pushed) == {188416}  # the adapters, never the model


def test_two_sharded_lora_learners_train_as_one_replicated(ray_session, tmp_path):
    """The frozen base sharded over two FSDP learners, the adapters replicated (their gradients summed across the
    learners, each answering the reference for its shard of rows) and pushed by learner 0, verified: the figures of
    one replicated learner, up to summation order."""
    common = ("run.steps=3", "learner.micro_batch_size=8")
    one = train(lora_config(tmp_path / "one", *common))
    two = train(lora_config(tmp_path / "two", *common, "learner.strategy=fsdp", "cluster.learner.num_actors=2",
                            "cluster.learner.num_cpus=0.25"))
    assert [h["step"] for h in two] == [1, 2, 3]
    assert all(abs(h["correction/mismatch_kl/staleness_0"]) < 1e-4 for h in two)
    assert all(h["sync/bytes"] == 188416 for h in two)
    for a, b in zip(one, two, strict=True):  # same samples, same update: the same figures up to summation order
        assert b["reward/mean"] == a["reward/mean"]
        assert abs(b["kl/ref"] - a["kl/ref"]) < 1e-5 and abs(b["loss/policy"] - a["loss/policy"]) < 1e-5
