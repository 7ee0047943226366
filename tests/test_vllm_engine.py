"""The arguments a rollout worker builds its vLLM engine with (`distrl.workers.rollout.vllm_engine.engine_args`): what
the config asks for, and the settings every engine needs (processed log-probs, prefix caching; on CPU whole prompts)."""

from __future__ import annotations

from distrl.config import LoraConfig, ModelConfig, RolloutConfig
from distrl.workers.rollout.vllm_engine import engine_args


def args(model_dir, **kwargs):
    options = dict(multi_turn=False, max_new_tokens=None, lora=None, on_gpu=False, sleep_mode=False,
                   in_process_group=False)
    cfg = RolloutConfig(**kwargs.pop("rollout", {}))
    return engine_args(cfg, ModelConfig(path=str(model_dir)), 100, 7, **{**options, **kwargs})


def test_every_engine_samples_processed_log_probs_with_its_seed_and_prefix_cache(tmp_path):
    a = args(tmp_path)
    assert (a["model"], a["tokenizer"]) == (str(tmp_path), str(tmp_path))
    assert a["logprobs_mode"] == "processed_logprobs" and a["enable_prefix_caching"] and a["seed"] == 7
    # On CPU: the configured KV cache, one process, whole prompts (a chunked prefill would rewind a CPU generator).
    assert (a["kv_cache_memory_bytes"], a["distributed_executor_backend"], a["enable_chunked_prefill"]) == (
        128 * 2**20, "uni", False)
    assert "enable_lora" not in a and "gpu_memory_utilization" not in a


def test_the_context_holds_the_longest_prompt_and_turn_or_the_models_own(tmp_path):
    sampling = {"sampling": {"max_new_tokens": 30}}
    assert args(tmp_path, rollout=sampling)["max_model_len"] == 100 + 30
    assert args(tmp_path, rollout=sampling, max_new_tokens=50)["max_model_len"] == 100 + 50  # an evaluation's
    assert args(tmp_path, rollout=sampling, multi_turn=True)["max_model_len"] is None
    assert args(tmp_path, rollout={**sampling, "max_model_len": 64}, multi_turn=True)["max_model_len"] == 64


def test_lora_a_gpu_and_a_hybrid_actor(tmp_path):
    a = args(tmp_path, lora=LoraConfig(rank=16), on_gpu=True, sleep_mode=True, in_process_group=True)
    assert (a["enable_lora"], a["max_lora_rank"], a["max_loras"]) == (True, 16, 1)
    assert (a["gpu_memory_utilization"], a["enable_sleep_mode"]) == (RolloutConfig().gpu_memory_utilization, True)
    assert a["distributed_executor_backend"] == "external_launcher" and "kv_cache_memory_bytes" not in a


def test_routing_replay_asks_the_engine_for_the_routed_experts(tmp_path):
    assert args(tmp_path, rollout={"routing_replay": True}, on_gpu=True)["enable_return_routed_experts"]
    assert "enable_return_routed_experts" not in args(tmp_path, on_gpu=True)
