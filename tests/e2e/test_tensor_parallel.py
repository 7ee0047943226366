"""Engines over two worker processes (`rollout.tensor_parallel_size: 2`, vLLM's CPU build). In this process, no Ray:
the same tokens and log-probs as one worker; a push from two learners' row blocks reaches both workers through
shared memory and each proves its slice (a wrong slice names the engine, the worker and the tensor); multi-turn
episodes take a push between engine steps; adapters reach both workers' LoRA slots; and closing the engine leaves
no worker process behind. On the session's cluster: the quickstart learns on a TP 2 engine, one of whose worker
processes is killed mid-run."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch

from distrl.config import EnvConfig, LoraConfig, ModelConfig, RolloutConfig
from distrl.types.prompt import Prompt
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training.model import load_causal_lm
from distrl.workers.weights.export import Bucket
from distrl.workers.weights.fingerprint import WeightMismatch, of_blocks
from distrl.workers.weights.pieces import BucketParts, Pieces
from tests.e2e.test_lora_push import push, served_vs_learner
from tests.test_lora import LORA, make_lora_learner, randomize_b

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PROMPTS = [Prompt(index=i, text="", prompt_ids=p) for i, p in enumerate([[5, 17, 33, 8], [40, 2, 9, 11, 12, 13]])]


def rollout_cfg(tp: int, **sampling) -> RolloutConfig:
    return RolloutConfig(dtype="float32", n_samples_per_prompt=2, tensor_parallel_size=tp,
                         sampling={"max_new_tokens": 8, "temperature": 1.0, **sampling})


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """One engine of one worker and one of two, on the same tiny model, float32."""
    one = RolloutWorker(rollout_cfg(1), ModelConfig(path=str(tiny_model_dir)), max_prompt_tokens=16, seed=0)
    two = RolloutWorker(rollout_cfg(2), ModelConfig(path=str(tiny_model_dir)), max_prompt_tokens=16, seed=0)
    yield one, two
    one.close()
    two.close()


def perturbed(model_dir, seed: int) -> dict[str, torch.Tensor]:
    model = load_causal_lm(ModelConfig(path=str(model_dir)), "float32")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)))
    return {name: t.contiguous() for name, t in model.state_dict().items()}


def two_learners(state: dict[str, torch.Tensor]) -> list[Pieces]:
    """What two sharded learners send: the first ceil(n / 2) rows of each tensor, and the rest (FSDP2's blocks)."""
    parts = [Pieces(Bucket(), {}), Pieces(Bucket(), {})]
    for name, tensor in state.items():
        half = -(-tensor.shape[0] // 2)
        for part, start, block in ((parts[0], 0, tensor[:half]), (parts[1], half, tensor[half:])):
            if block.numel():
                part.tensors[name], part.rows[name] = block.clone(), start
    return parts


def fingerprint_parts(parts: list[Pieces], state: dict[str, torch.Tensor], regions) -> list[dict]:
    return [of_blocks(((n, p.tensors[n], p.rows[n], state[n].shape[0]) for n in p.tensors), regions, torch.float32)
            for p in parts]


def test_two_workers_sample_the_same_tokens_and_log_probs_as_one(engines):
    one, two = engines
    assert len(set(two.worker_pids())) == 2 and one.worker_pids() == [psutil.Process().pid]
    a, b = one.generate(PROMPTS, [0, 1]), two.generate(PROMPTS, [0, 1])  # seeded per request: the same draws
    assert a.response_ids == b.response_ids
    worst = max(abs(x - y) for xs, ys in zip(a.rollout_logprobs, b.rollout_logprobs, strict=True)
                for x, y in zip(xs, ys, strict=True))
    assert worst < 1e-5, worst


def test_a_push_from_two_learners_reaches_both_workers_and_each_proves_its_slice(engines, tiny_model_dir):
    one, two = engines
    state = perturbed(tiny_model_dir, seed=1)
    spec = [(name, tuple(t.shape)) for name, t in state.items()]
    buckets = [BucketParts(spec[:9], two_learners(state)), BucketParts(spec[9:], two_learners(state))]
    for engine in (one, two):
        assert engine.load_weights(1, buckets) == 1
    regions = two.weight_regions()
    # Column-parallel output rows, row-parallel input columns, vocabulary halves; norms whole on both workers.
    assert regions["model.layers.0.self_attn.q_proj.weight"] == [(0, 0, 64), (0, 64, 64)]
    assert regions["model.layers.0.mlp.down_proj.weight"] == [(1, 0, 256), (1, 256, 256)]
    assert regions["model.embed_tokens.weight"] == [(0, 0, 256), (0, 256, 256)]
    assert regions["model.norm.weight"] == [None]
    assert two.check_weights(1, "rollout-1", *fingerprint_parts(two_learners(state), state, regions)) == 1
    assert one.check_weights(1, "rollout-0", *fingerprint_parts(two_learners(state), state, None)) == 1
    a, b = one.generate(PROMPTS, [2, 3]), two.generate(PROMPTS, [2, 3])
    assert a.response_ids == b.response_ids

    # Worker 1 serves a stale slice of one tensor (rows 64-127 of q_proj): only its check fails, naming it.
    stale = dict(state)
    stale["model.layers.1.self_attn.q_proj.weight"] = state["model.layers.1.self_attn.q_proj.weight"].clone()
    stale["model.layers.1.self_attn.q_proj.weight"][64:] += 0.5
    two.load_weights(2, [BucketParts.whole(stale)])
    with pytest.raises(WeightMismatch, match=r"^rollout-1 \(worker 1 of 2\) serves weights other than the learners' "
                                             r"after loading version 2: model\.layers\.1\.self_attn\.q_proj\.weight"
                                             r"\[0:64:64\] differs .*; 1 of \d+ tensors differ"):
        two.check_weights(2, "rollout-1", *fingerprint_parts(two_learners(state), state, regions))


def test_a_push_while_episodes_run_lands_between_engine_steps_on_both_workers(tiny_model_dir):
    """Multi-turn episodes waiting on their environment: the push lands between two engine steps, later turns are
    sampled by the new weights (stamped 1) on both workers, and the engine's scoring gives exactly the sampler's
    log-probs of those tokens."""
    env = EnvConfig.model_validate({"class": "tests.agent_envs:Chatter", "kwargs": {"turns": 3, "sleep": 1.0}})
    cfg = rollout_cfg(2, max_new_tokens=6)
    engine = RolloutWorker(cfg, ModelConfig(path=str(tiny_model_dir)), max_prompt_tokens=64, seed=5,
                           environment=env)
    try:
        prompts = [Prompt(index=i, text=q, prompt_ids=[], sample={"prompt": q}) for i, q in enumerate(["1 2", "hi"])]
        engine.generate(prompts[:1], [9])  # the engine's first steps are slow (warm-up): not under the clock below
        results = []
        generating = threading.Thread(target=lambda: results.append(engine.generate(prompts, [0, 1])))
        generating.start()
        time.sleep(0.5)  # every episode has sampled its first turn and waits on its environment
        assert engine.load_weights(1, [BucketParts.whole(perturbed(tiny_model_dir, seed=3))]) == 1
        generating.join(timeout=180)
        out = results[0]
        for i in range(len(out)):
            trained = [v for v, m in zip(out.token_versions[i], out.loss_mask[i], strict=True) if m]
            assert set(trained) == {0, 1} and trained == sorted(trained)
            scored = engine.score([out.prompt_ids[i] + out.response_ids[i]], len(out.prompt_ids[i]))[0]
            new = [(s, r) for s, r, m, v in zip(scored, out.rollout_logprobs[i], out.loss_mask[i],
                                                  out.token_versions[i], strict=True) if m and v == 1]
            assert new and max(abs(s - r) for s, r in new) < 1e-5
    finally:
        pids = engine.worker_pids()
        engine.close()
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def test_adapters_reach_both_workers_lora_slots_and_are_served(tiny_model_dir):
    learner = make_lora_learner(tiny_model_dir)
    randomize_b(learner.model)
    engine = RolloutWorker(rollout_cfg(2), ModelConfig(path=str(tiny_model_dir)), max_prompt_tokens=16, seed=0,
                           lora=LoraConfig(**LORA))
    try:
        push(learner, engine, 1)
        regions = engine.weight_regions()
        # A column-parallel projection's B is cut by output rows, a row-parallel one's A by input columns.
        assert regions["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"] == [(0, 0, 64), (0, 64, 64)]
        assert regions["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"] == [None]
        assert regions["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"] == [(1, 0, 256), (1, 256, 256)]
        assert engine.check_weights(1, "rollout-0", learner.weights_fingerprint("float32", regions)) == 1
        assert served_vs_learner(engine, learner) < 1e-5
    finally:
        engine.close()
