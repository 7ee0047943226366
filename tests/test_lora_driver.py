"""Both loops with `learner.lora` on the local backend (the learner in the driver's process, an HF sampler for the
engine): the adapters are pushed and verified every step, the reference is the learner's base model (no reference
role), the async loop keeps its staleness bound, and a resumed run gives exactly the rows of one never interrupted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distrl.driver import train
from tests.hf_rollout import HFRolloutWorker
from tests.test_driver_local import local_config, rows

LORA = ("learner.lora.rank=8", "learner.lora.alpha=16", "learner.lr=1e-2", "rollout.dtype=float32")
TIMING = ("time/", "throughput/", "rollout/tokens_per_s", "rollout/engine_busy_frac", "sync/bytes_per_s", "idle/")


def outcome(cfg) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith(TIMING)} for row in rows(cfg)]


def test_sync_lora_pushes_the_adapters_and_the_reference_is_the_base(tmp_path, tiny_model_dir):
    cfg = local_config(tmp_path, tiny_model_dir, *LORA)
    assert cfg.needs_ref_logprobs and not cfg.needs_reference
    history = train(cfg, rollout_worker=HFRolloutWorker)
    assert [h["policy_version"] for h in history] == [0, 1, 2, 3]
    # Every push is the adapters alone: 2 layers x 7 projections x (A + B), rank 8, float32.
    hidden, inter = 128, 512  # the tiny Llama (make_tiny_model): q/k/v/o 128 -> 128, gate/up 128 -> 512, down back
    per_layer = 4 * 8 * (hidden + hidden) + 3 * 8 * (hidden + inter)  # A [8, in] + B [out, 8] each
    assert all(h["sync/bytes"] == 2 * per_layer * 4 for h in history[:-1])
    # The sampler serves the learner's adapters (fp32 on both sides): the old log-probs are the rollout's.
    assert all(abs(h["correction/mismatch_kl/staleness_0"]) < 1e-5 for h in history)
    assert history[0]["kl/ref"] == pytest.approx(0.0, abs=1e-6)  # B = 0: the first policy is the base
    assert history[-1]["kl/ref"] > 1e-4  # the adapters moved it away from the base, which the reference stayed
    assert "idle/reference" not in history[0]


def test_async_lora_respects_the_staleness_bound(tmp_path, tiny_model_dir):
    cfg = local_config(tmp_path, tiny_model_dir, *LORA, "loop.mode=async", "loop.max_staleness=1", "run.steps=4")
    history = train(cfg, rollout_worker=HFRolloutWorker)
    assert [r["step"] for r in rows(cfg)] == [1, 2, 3, 4]
    assert max(h["staleness/max"] for h in history) == 1
    assert all(h["learner/tokens"] > 0 and h["kl/ref"] >= 0 for h in history)


def test_a_resumed_lora_run_gives_the_rows_of_one_never_interrupted(tmp_path, tiny_model_dir):
    common = (*LORA, "run.checkpoint_every=2", "data.shuffle=false")
    whole = local_config(tmp_path / "whole", tiny_model_dir, *common)
    train(whole, rollout_worker=HFRolloutWorker)
    cut = local_config(tmp_path / "cut", tiny_model_dir, *common, "run.steps=3", "run.checkpoint_at_end=false")
    train(cut, rollout_worker=HFRolloutWorker)  # step 3 trained, not saved: the resume redoes it
    policy = Path(cut.run.output_dir) / "quickstart" / "checkpoints" / "step_000002" / "policy"
    assert json.loads((policy / "adapter" / "adapter_config.json").read_text())["r"] == 8
    assert (policy / "adapter" / "adapter_model.safetensors").is_file() and not (policy / "model").exists()
    resumed = local_config(tmp_path / "cut", tiny_model_dir, *common, "run.resume=true", "run.overwrite=false")
    train(resumed, rollout_worker=HFRolloutWorker)
    assert [r["step"] for r in rows(resumed)] == [1, 2, 3, 4]
    assert outcome(resumed) == outcome(whole)
