"""Multi-turn episodes on a real vLLM engine: the trajectory is token-exact (each turn's prompt is the trajectory
so far; the sampler's log-probs equal the engine's own scoring of the assembled sequence), observations are the
chat template's deltas and masked, and a multi-turn job trains end to end through Ray actors."""

import gc
import json
import os
import threading
import time

import pytest
import torch

from distrl.agents.chat import ChatRenderer
from distrl.config import EnvConfig, from_dict
from distrl.types.prompt import Prompt
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training.model import load_causal_lm
from distrl.workers.weights import export
from distrl.workers.weights.pieces import BucketParts
from tests.agent_envs import TOOLS
from tests.e2e.conftest import quickstart, start_quickstart
from tests.e2e.faults import finish, kill_actor, rows_of


@pytest.fixture(scope="module")
def cfg(tiny_model_dir):
    return from_dict({"model": {"path": str(tiny_model_dir)}, "data": {"path": "unused"},
                      "rollout": {"dtype": "float32", "n_samples_per_prompt": 2, "sampling": {"max_new_tokens": 6}}})


@pytest.fixture(scope="module")
def worker(cfg):
    env = EnvConfig.model_validate({"class": "tests.agent_envs:Chatter", "kwargs": {"turns": 3}})
    worker = RolloutWorker(cfg.rollout, cfg.model, max_prompt_tokens=64, seed=3, environment=env)
    yield worker
    del worker
    gc.collect()


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values in `mask`."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_a_three_turn_episode_is_token_exact_with_masked_observations(worker):
    prompts = [Prompt(index=i, text=q, prompt_ids=[], sample={"prompt": q}) for i, q in enumerate(["1 2 3", "hi"])]
    out = worker.generate(prompts, [0, 1])
    tok, chat = worker.tokenizer, ChatRenderer(worker.tokenizer)
    assert len(out) == 4 and out.group == [0, 0, 1, 1]
    for i in range(len(out)):
        episode = out.episodes[i]
        assert (episode.turns, episode.cut, episode.drift) == (3, None, 0)
        assert out.prompt_ids[i] == chat.prompt_ids([{"role": "user", "content": prompts[i // 2].sample["prompt"]}],
                                                    TOOLS)
        # turn, observation, turn, observation, turn: each observation is the template's delta for "result k",
        # after the EOS the template writes where a 6-token turn was cut short.
        pattern = runs(out.loss_mask[i])
        assert [v for v, _, _ in pattern] == [1, 0, 1, 0, 1]
        for k, (_, a, b) in enumerate(pattern[1::2]):
            given = out.response_ids[i][a:b]
            after = out.response_ids[i][a - 1] == tok.eos_token_id
            expected = chat.observation_ids([{"role": "tool", "content": f"result {k}"}], TOOLS, tok.eos_token_id)
            assert given == ([] if after else [tok.eos_token_id]) + expected
        assert all(v == 0 for v in out.token_versions[i]) and out.policy_version[i] == 0
        # The engine's own scoring of the whole trajectory gives the sampler's log-probs on the model's tokens.
        scored = worker.score([out.prompt_ids[i] + out.response_ids[i]], len(out.prompt_ids[i]))[0]
        trained = [(s, r) for s, r, m in zip(scored, out.rollout_logprobs[i], out.loss_mask[i], strict=True) if m]
        assert max(abs(s - r) for s, r in trained) < 1e-5
        assert all(r == 0.0 for r, m in zip(out.rollout_logprobs[i], out.loss_mask[i], strict=True) if not m)


def test_a_multi_turn_job_trains_through_ray_actors(ray_session, tmp_path):
    from distrl.driver import train

    cfg = quickstart(tmp_path, "run.steps=2", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
                     "rollout.sampling.max_new_tokens=6", "env.class=tests.agent_envs:Chatter",
                     "env.kwargs.turns=2", "loss.kl.coef=0.0", "learner.micro_batch_size=4")
    history = train(cfg)
    assert len(history) == 2
    rows = [json.loads(line) for line in (tmp_path / cfg.run.name / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["agent/turns_mean"] == 2.0 and row["agent/retokenization_drift"] == 0.0
        assert 0.0 < row["agent/masked_frac"] < 1.0 and row["agent/cut_frac"] == 0.0
        assert row["loss/policy"] is not None


def test_an_environment_actor_killed_mid_run_is_restarted_and_its_episodes_run_again(ray_session, tmp_path):
    proc, metrics = start_quickstart(tmp_path, "run.steps=5", "rollout.sampling.max_new_tokens=6",
                                     "env.class=tests.agent_envs:Chatter", "env.kwargs.turns=2",
                                     "env.kwargs.sleep=0.05", cluster=ray_session)
    kill_actor(os.getpid(), "EnvHost")  # step 3's episodes are under way (its chunk went out with step 2's push)
    _, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    rows = rows_of(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert sum(r["faults/env_restarted_episodes"] for r in rows) >= 1
    assert all(r["agent/retokenization_drift"] == 0 and r["agent/turns_mean"] == 2.0 for r in rows)


def test_a_step_whose_prompts_pass_the_engines_token_budget_is_generated(cfg):
    """64 seeded requests of 300 prompt tokens (19,200 > vLLM's 4096 a step): with chunked prefill vLLM's CPU build
    crashed rewinding the seeded generators of split prompts."""
    prompts = [Prompt(index=i, text="", prompt_ids=[(7 * i + j) % 400 + 10 for j in range(300)]) for i in range(32)]
    out = RolloutWorker(cfg.rollout, cfg.model, max_prompt_tokens=300, seed=3).generate(prompts, list(range(32)))
    assert len(out) == 64 and all(len(ids) == 6 for ids in out.response_ids)


def test_a_push_while_episodes_run_lands_between_engine_steps_and_each_token_keeps_its_version(cfg):
    """Weights of version 1 are loaded while three-turn episodes wait on their environment (1 s a step): their
    later turns are sampled by the new weights, stamped 1, and the engine's scoring with the new weights gives
    exactly the sampler's log-probs of those tokens; the sample's policy version is its oldest token's (0)."""
    env = EnvConfig.model_validate({"class": "tests.agent_envs:Chatter", "kwargs": {"turns": 3, "sleep": 1.0}})
    engine = RolloutWorker(cfg.rollout, cfg.model, max_prompt_tokens=64, seed=5, environment=env)
    prompts = [Prompt(index=i, text=q, prompt_ids=[], sample={"prompt": q}) for i, q in enumerate(["1 2 3", "hi"])]
    engine.generate(prompts[:1], [9])  # the engine's first steps are slow (warm-up): not under the clock below
    learner = load_causal_lm(cfg.model, "float32")
    with torch.no_grad():
        for param in learner.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(0)))
    buckets = [export.bucket(learner, spec, "float32") for spec in export.specs(learner, 2**20, "float32")]
    results = []

    def generate() -> None:
        results.append(engine.generate(prompts, [0, 1]))

    generating = threading.Thread(target=generate)
    generating.start()
    time.sleep(0.5)  # every episode has sampled its first turn and waits on its environment
    assert engine.load_weights(1, [BucketParts.whole(b) for b in buckets]) == 1
    generating.join(timeout=120)
    out = results[0]
    for i in range(len(out)):
        trained = [v for v, m in zip(out.token_versions[i], out.loss_mask[i], strict=True) if m]
        assert set(trained) == {0, 1} and trained == sorted(trained)  # turn 1 by version 0, the rest by 1
        assert out.policy_version[i] == 0
        scored = engine.score([out.prompt_ids[i] + out.response_ids[i]], len(out.prompt_ids[i]))[0]
        new = [(s, r) for s, r, m, v in zip(scored, out.rollout_logprobs[i], out.loss_mask[i], out.token_versions[i],
                                              strict=True) if m and v == 1]
        assert new and max(abs(s - r) for s, r in new) < 1e-5
