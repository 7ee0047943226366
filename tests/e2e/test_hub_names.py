"""A real vLLM CPU engine serves a hub-named model resolved offline from the Hugging Face cache, on prompts from a
hub-named data set resolved the same way: the cache (the tiny model and a GSM8K-shaped data set, in the hub's layout)
is in a temporary HF_HOME, HF_HUB_OFFLINE is set, and neither name is a local path. The engine's log-probs of what
it sampled equal those of the same weights loaded by transformers from the original directory (fp32): it serves the
snapshot the name points at."""

import gc

import torch

from distrl.config import from_dict
from distrl.data.prompts import load_prompts
from distrl.workers.model_files import load_tokenizer, resolve_model_path
from distrl.workers.rollout.worker import RolloutWorker
from tests.hub_cache import cache_gsm8k_like, cache_model

NAME = "distrl-tests/tiny-llama"


def test_a_vllm_engine_serves_a_hub_named_model_on_a_hub_named_data_set_offline(tiny_model_dir, tmp_path,
                                                                                monkeypatch):
    from transformers import AutoModelForCausalLM

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    snapshot = cache_model(tmp_path / "hf" / "hub", NAME, tiny_model_dir)
    cache_gsm8k_like(tmp_path / "hf" / "hub", train=4)
    cfg = from_dict({"model": {"path": NAME},
                     "data": {"path": "openai/gsm8k", "subset": "main", "prompt": "{question}",
                              "max_prompt_tokens": 32},
                     "rollout": {"dtype": "float32", "n_samples_per_prompt": 2,
                                 "sampling": {"max_new_tokens": 6, "temperature": 1.0}}})
    assert resolve_model_path(cfg.model) == str(snapshot)
    prompts, _ = load_prompts(cfg.data, load_tokenizer(cfg.model))
    worker = RolloutWorker(cfg.rollout, cfg.model, max_prompt_tokens=32, seed=0)
    try:
        rollouts = worker.generate(prompts[:2], [0, 1])
        assert len(rollouts.response_ids) == 4 and all(rollouts.response_ids)
        prompt, response = rollouts.prompt_ids[0], rollouts.response_ids[0]
        (served,) = worker.score([prompt + response], len(prompt))
    finally:
        del worker
        gc.collect()
    local = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = local(input_ids=torch.tensor([prompt + response])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    expected = [float(logprobs[len(prompt) - 1 + t, token]) for t, token in enumerate(response)]
    assert torch.allclose(torch.tensor(served), torch.tensor(expected), atol=1e-4)
