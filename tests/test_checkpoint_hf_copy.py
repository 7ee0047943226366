"""A checkpoint's HF copy is written in the rollout dtype with its tokenizer (`distrl.workers.weights.hf_export`), while
resume stays exact from the float32 weights of the trainer's state; and the manifest is built from the files each
writer reports, with digests computed where they were written: the driver hashes only its own driver_state.json
and lists no directory."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from test_learner import batch, make_learner, scored, update, weights

from distrl import checkpoint


def save_bf16(learner, path, step: int = 1):
    tmp = checkpoint.begin(path)
    written = learner.save_checkpoint(str(tmp / "policy"), "bfloat16")
    return checkpoint.finish(tmp, {"step": step}, {"policy": [written]})


def test_the_hf_copy_is_bf16_with_the_tokenizer_and_loads_with_transformers(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    learner = make_learner(tiny_model_dir)
    update(learner, scored(learner, batch()))
    path = save_bf16(learner, tmp_path / "step_000001")
    model_dir = path / "policy" / "model"
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 - safe_open has no iter
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    assert next(loaded.parameters()).dtype == torch.bfloat16
    for name, w in weights(learner).items():  # the trained weights, rounded to bfloat16
        torch.testing.assert_close(loaded.state_dict()[name], w.to(torch.bfloat16), rtol=0, atol=0, msg=name)
    text = "The answer is #### 42"
    assert AutoTokenizer.from_pretrained(model_dir)(text).input_ids == \
        AutoTokenizer.from_pretrained(tiny_model_dir)(text).input_ids


def test_resume_from_a_bf16_copy_is_exact_from_the_float32_weights(tiny_model_dir, tmp_path):
    first = make_learner(tiny_model_dir)
    update(first, scored(first, batch()))
    path = save_bf16(first, tmp_path / "step_000001")
    second = make_learner(tiny_model_dir)
    second.load_checkpoint(str(path / "policy"), 1)
    for name, w in weights(first).items():
        torch.testing.assert_close(weights(second)[name], w, rtol=0, atol=0, msg=name)
    nxt = batch(advantage=-1.0)
    a, b = update(first, scored(first, nxt)), update(second, scored(second, nxt))
    assert a["loss/policy"] == b["loss/policy"]


def test_the_manifest_comes_from_the_writers_lists_and_the_driver_hashes_only_its_own_file(tiny_model_dir, tmp_path,
                                                                                          monkeypatch):
    learner = make_learner(tiny_model_dir)
    tmp = checkpoint.begin(tmp_path / "step_000001")
    written = learner.save_checkpoint(str(tmp / "policy"), "bfloat16")
    assert {"model/config.json", "model/tokenizer.json", "trainer_state.json"} <= written.keys()
    (tmp / "policy" / "stray.txt").write_text("not reported by any writer")
    hashed = []
    real = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda path: hashed.append(path.name) or real(path))
    monkeypatch.setattr(type(tmp), "rglob", lambda *a: pytest.fail("finish listed a directory"))
    path = checkpoint.finish(tmp, {"step": 1}, {"policy": [written, {}]})
    assert hashed == ["driver_state.json"]
    listed = json.loads((path / "manifest.json").read_text())["files"]
    assert "policy/stray.txt" not in listed
    assert listed["policy/model/config.json"] == written["model/config.json"]
    monkeypatch.undo()
    assert checkpoint.problem(path) is None  # every reported digest is the file's


def test_a_tied_replicas_checkpoint_stores_the_tied_weight_once_and_resumes_tied(tmp_path):
    """distrl's tiny Qwen2 (tied embeddings, as Qwen2.5): the float32 weights in the trainer state hold the tied
    matrix once (safetensors refuses two names on one storage), and a resumed learner has it tied again."""
    from distrl.workers.tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "qwen2", arch="qwen2")
    first = make_learner(model_dir)
    update(first, scored(first, batch()))
    path = save_bf16(first, tmp_path / "step_000001")
    second = make_learner(model_dir)
    second.load_checkpoint(str(path / "policy"), 1)
    assert second.model.lm_head.weight is second.model.model.embed_tokens.weight
    for name, w in weights(first).items():
        torch.testing.assert_close(weights(second)[name], w, rtol=0, atol=0, msg=name)
