"""Agent functions (`env.agent`) on a real vLLM engine: an agent written with the OpenAI client plays its episodes
through the rollout worker's endpoint; every sequence is token-exact (the engine's own scoring of it gives the
sampler's log-probs on the model's tokens), a call on a fresh conversation becomes a sequence of its own, and an
agent job trains end to end through Ray actors, its agents in environment actors calling the rollout actors'
endpoints."""

import gc
import json
import socket

import pytest

from distrl.agents.chat import ChatRenderer
from distrl.config import EnvConfig, from_dict
from distrl.types.prompt import Prompt
from distrl.workers.rollout.worker import RolloutWorker
from tests.agent_envs import TOOLS
from tests.e2e.conftest import quickstart


@pytest.fixture(scope="module")
def worker(tiny_model_dir):
    cfg = from_dict({"model": {"path": str(tiny_model_dir)}, "data": {"path": "unused"},
                     "rollout": {"dtype": "float32", "n_samples_per_prompt": 2, "sampling": {"max_new_tokens": 6}}})
    env = EnvConfig.model_validate({"agent": "tests.agent_envs:tool_agent", "kwargs": {"turns": 2, "fresh": True}})
    worker = RolloutWorker(cfg.rollout, cfg.model, max_prompt_tokens=64, seed=3, environment=env)
    yield worker
    host, port = worker.endpoint.url.removeprefix("http://").split(":")
    worker.close()  # the endpoint stops listening with its worker
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((host, int(port)), timeout=5).close()
    del worker
    gc.collect()


def test_an_agent_written_with_the_openai_client_gives_token_exact_sequences(worker):
    prompts = [Prompt(index=i, text=q, prompt_ids=[], sample={"prompt": q}) for i, q in enumerate(["1 2 3", "hi"])]
    out = worker.generate(prompts, [0, 1])
    chat = ChatRenderer(worker.tokenizer)
    # Each episode: its conversation (two calls, the tool's answer between them), then the summary call.
    assert len(out) == 8 and out.group == [0] * 4 + [1] * 4
    assert [e.segment for e in out.episodes] == [0, 1] * 4
    for i in range(0, 8, 2):
        first, summary = out.episodes[i], out.episodes[i + 1]
        assert (first.turns, first.drift, first.cut) == (3, 0, None) and summary.reward == first.reward
        question = prompts[i // 4].sample["prompt"]
        assert out.prompt_ids[i] == chat.prompt_ids([{"role": "user", "content": question}], TOOLS)
        assert out.loss_mask[i].count(0) > 0 and all(out.loss_mask[i + 1])
        assert out.prompt_ids[i + 1][:len(out.prompt_ids[i])] != out.prompt_ids[i]
    for i in range(len(out)):
        scored = worker.score([out.prompt_ids[i] + out.response_ids[i]], len(out.prompt_ids[i]))[0]
        trained = [(s, r) for s, r, m in zip(scored, out.rollout_logprobs[i], out.loss_mask[i], strict=True) if m]
        assert max(abs(s - r) for s, r in trained) < 1e-5


def test_an_agent_job_trains_through_ray_actors(ray_session, tmp_path):
    from distrl.driver import train

    cfg = quickstart(tmp_path, "run.steps=2", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2",
                     "rollout.sampling.max_new_tokens=6", "env.agent=tests.agent_envs:tool_agent",
                     "env.kwargs.turns=2", "env.kwargs.fresh=true", "loss.kl.coef=0.0",
                     "learner.micro_batch_size=4")
    assert len(train(cfg)) == 2
    rows = [json.loads(line) for line in (tmp_path / cfg.run.name / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["agent/turns_mean"] == 3.0 and row["agent/retokenization_drift"] == 0.0
        assert row["agent/non_continuations"] == 4.0 and row["agent/sequences_per_episode"] == 2.0
        assert row["loss/policy"] is not None
