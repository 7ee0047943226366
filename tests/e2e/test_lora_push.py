"""Adapter pushes into a real vLLM engine (CPU build, in this process, no Ray): the engine serves the learner's
adapters (its log-probs equal HF+PEFT's to ~1e-6 in fp32, sampled and scored), the fingerprint check reads the
engine's active LoRA slot, and an engine still serving an older adapter, or the base model, fails it."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from distrl.config import LoraConfig, ModelConfig, RolloutConfig
from distrl.types.prompt import Prompt
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training.learner import Learner
from distrl.workers.weights.fingerprint import WeightMismatch
from distrl.workers.weights.pieces import BucketParts
from tests.test_learner import batch, scored, update
from tests.test_lora import LORA, make_lora_learner, randomize_b

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPTS = [[5, 17, 33, 8], [40, 2, 9, 11, 12, 13], [7, 7, 100, 101, 102]]


def push(learner: Learner, worker: RolloutWorker, version: int) -> None:
    buckets = [learner.weight_bucket(spec, "float32") for spec in learner.weight_specs(4096, "float32")]
    assert worker.load_weights(version, [BucketParts.whole(b) for b in buckets]) == version


def engine(model_dir, seed: int) -> RolloutWorker:
    cfg = RolloutConfig(dtype="float32", n_samples_per_prompt=2, sampling={"max_new_tokens": 8, "temperature": 1.0})
    return RolloutWorker(cfg, ModelConfig(path=str(model_dir)), max_prompt_tokens=16, seed=seed,
                         lora=LoraConfig(**LORA))


def served_vs_learner(worker: RolloutWorker, learner: Learner) -> float:
    """Largest |vLLM - learner| over the response log-probs of samples the engine draws now, and of the engine's
    own scoring of them (temperature 1: vLLM's processed log-probs are the raw ones)."""
    from distrl.batching import pad

    rollouts = worker.generate([Prompt(index=i, text="", prompt_ids=p) for i, p in enumerate(PROMPTS)],
                               list(range(len(PROMPTS))))
    sequences = pad(rollouts, 0)
    mine = learner.logprobs(sequences, 1.0)
    mask = sequences.response_mask.bool()
    worst = (sequences.rollout_logprobs - mine)[mask].abs().max().item()
    for i, (prompt, response) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids, strict=True)):
        (scored_lp,) = worker.score([prompt + response], len(prompt))
        worst = max(worst, (torch.tensor(scored_lp) - mine[i, : len(response)]).abs().max().item())
    return worst


@pytest.fixture(scope="module")
def pair(tiny_model_dir):
    learner = make_lora_learner(tiny_model_dir)
    randomize_b(learner.model)  # B = 0 would serve the base model: the check must see the adapters
    first, second = engine(tiny_model_dir, 0), engine(tiny_model_dir, 1)
    yield learner, first, second
    first.close()
    second.close()


def test_the_engine_serves_the_pushed_adapters_and_the_check_reads_its_slot(pair):
    learner, first, _ = pair
    push(learner, first, 1)
    assert first.check_weights(1, "rollout 0", learner.weights_fingerprint("float32")) == 1
    assert served_vs_learner(first, learner) < 1e-5
    with learner.model.disable_adapter():  # the adapters change what is served
        assert served_vs_learner(first, learner) > 1e-2


def test_a_stale_engine_and_a_base_engine_fail_the_check(pair, tiny_model_dir):
    learner, first, second = pair
    with pytest.raises(WeightMismatch, match="rollout 1 serves weights other than the learners'"):
        second.check_weights(1, "rollout 1", learner.weights_fingerprint("float32"))  # never given an adapter
    push(learner, second, 1)
    for _ in range(2):
        update(learner, scored(learner, replace(batch(), advantages=batch().advantages * 3)))
    expected = learner.weights_fingerprint("float32")
    push(learner, first, 2)
    assert first.check_weights(2, "rollout 0", expected) == 2
    with pytest.raises(WeightMismatch, match=r"lora_[AB]\.weight differs"):  # still version 1's adapters
        second.check_weights(1, "rollout 1", expected)
    with pytest.raises(WeightMismatch, match="is not among the tensors it serves"):  # asked for a version it lacks
        second.check_weights(2, "rollout 1", expected)
    assert served_vs_learner(first, learner) < 1e-5
    push(learner, second, 2)  # a new id and name per version: nothing of version 1 is served
    assert second.check_weights(2, "rollout 1", expected) == 2
    assert served_vs_learner(second, learner) < 1e-5


def test_vllm_serves_the_merged_export_as_the_adapted_policy(pair, tiny_model_dir, tmp_path):
    from distrl.config import from_dict
    from distrl.export_command import export
    from tests.test_learner import save

    learner, _, _ = pair
    path = save(learner, tmp_path / "step_000002", 2)
    cfg = from_dict({"model": {"path": str(tiny_model_dir)}, "data": {"path": "d.jsonl"},
                     "reward": {"function": "distrl.tasks.toy:reward"}, "learner": {"lora": LORA}})
    merged = export(cfg, str(path), str(tmp_path / "merged"), merge=True)
    cfg = RolloutConfig(dtype="float32", n_samples_per_prompt=2, sampling={"max_new_tokens": 8, "temperature": 1.0})
    plain = RolloutWorker(cfg, ModelConfig(path=str(merged)), max_prompt_tokens=16, seed=2)  # no LoRA: a plain model
    try:
        assert served_vs_learner(plain, learner) < 1e-5
    finally:
        plain.close()


def test_a_bfloat16_engine_passes_the_check_with_the_adapters_cast_as_it_holds_them(tiny_model_dir):
    # GPU configs sample in bfloat16: vLLM casts the adapters to bf16 and scales B in bf16; learner 0's fingerprint
    # of what it sent must follow the same two roundings exactly.
    learner = make_lora_learner(tiny_model_dir)
    randomize_b(learner.model)
    cfg = RolloutConfig(dtype="bfloat16", n_samples_per_prompt=2, sampling={"max_new_tokens": 8})
    bf16 = RolloutWorker(cfg, ModelConfig(path=str(tiny_model_dir)), max_prompt_tokens=16, seed=3,
                         lora=LoraConfig(**LORA))
    try:
        buckets = [learner.weight_bucket(spec, "bfloat16") for spec in learner.weight_specs(4096, "bfloat16")]
        bf16.load_weights(1, [BucketParts.whole(b) for b in buckets])
        assert bf16.check_weights(1, "rollout 0", learner.weights_fingerprint("bfloat16")) == 1
        assert served_vs_learner(bf16, learner) < 0.1  # bf16 kernels against the fp32 learner
    finally:
        bf16.close()


def test_a_push_during_a_turn_waits_for_it_and_later_turns_use_the_new_adapters(tiny_model_dir):
    # A vLLM request keeps the adapters it was added with: the push drains the engine (the turn in flight finishes
    # with version 1's adapters and is stamped 1), then swaps; the next turns sample, stamped 2, with version 2's.
    import threading
    import time

    from distrl.batching import pad

    old, new = make_lora_learner(tiny_model_dir), make_lora_learner(tiny_model_dir)
    randomize_b(old.model, seed=1)
    randomize_b(new.model, seed=2)
    cfg = RolloutConfig(dtype="float32", n_samples_per_prompt=4, sampling={"max_new_tokens": 160})
    worker = RolloutWorker(cfg, ModelConfig(path=str(tiny_model_dir)), max_prompt_tokens=16, seed=4,
                           lora=LoraConfig(**LORA))
    try:
        push(old, worker, 1)
        worker.generate([Prompt(index=0, text="", prompt_ids=PROMPTS[0])], [0])  # warm-up, off the clock
        results, ended = [], []

        def generate() -> None:
            results.append(worker.generate([Prompt(index=i, text="", prompt_ids=p) for i, p in enumerate(PROMPTS)],
                                           [1, 2, 3]))
            ended.append(time.perf_counter())

        generating = threading.Thread(target=generate)
        generating.start()
        time.sleep(0.3)
        began = time.perf_counter()
        push(new, worker, 2)
        generating.join(timeout=120)
        assert began < ended[0]  # the push came mid-turn; its tokens, all stamped 1, are version 1's below
        (rollouts,) = results
        assert {v for versions in rollouts.token_versions for v in versions} == {1}
        sequences = pad(rollouts, 0)
        mask = sequences.response_mask.bool()
        assert (sequences.rollout_logprobs - old.logprobs(sequences, 1.0))[mask].abs().max() < 1e-5
        assert worker.check_weights(2, "rollout 0", new.weights_fingerprint("float32")) == 2
        assert served_vs_learner(worker, new) < 1e-5
    finally:
        worker.close()
