"""The vLLM engine a rollout worker holds: the environment vLLM must find when it is imported, and the arguments the
engine is built with from the config (in-process engine core, processed log-probs, prefix caching, a LoRA slot, GPU
memory or a CPU KV cache, the external launcher of a hybrid actor's engine). Why each matters:
`distrl.workers.rollout.worker`.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from distrl.config import LoraConfig, ModelConfig, RolloutConfig
from distrl.workers.model_files import resolve_model_path, tokenizer_path
from distrl.workers.rollout.worker_extension import WORKER_EXTENSION

ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""Environment of every rollout process, needed before vLLM is imported (set by the cluster layer, and here).
vLLM logs each weight reload at INFO; `cluster.actor_env` can set VLLM_LOGGING_LEVEL=INFO back. On CPU, the worker
processes of a tensor-parallel engine take the actor's thread share (`worker_threads`) instead of vLLM binding each
to a NUMA node of its own, which it requires by default (and a host with one node then refuses TP > 1);
`cluster.actor_env` can set VLLM_CPU_OMP_THREADS_BIND back (`auto`, or explicit core lists) on hosts with several."""


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def _rotary_cache_not_in_checkpoint(record: logging.LogRecord) -> bool:
    """Drops vLLM's warning "RotaryEmbedding: Failed to load weights", logged at every reload: the rotary cos/sin
    cache is a buffer that no checkpoint carries, so vLLM keeps the one it has. Harmless (the log-prob match test
    covers the real weights), and at every step it buried the progress bar. Other layers' failures still show."""
    return not (record.msg == "%s: Failed to load weights" and record.args == ("RotaryEmbedding",))


def import_llm() -> Any:
    """vLLM's `LLM` class, imported with `ENGINE_ENV` set (where the process has not set it otherwise), and the
    reload's harmless rotary-cache warning filtered out."""
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    from vllm import LLM

    logging.getLogger(RELOAD_LOGGER).addFilter(_rotary_cache_not_in_checkpoint)
    return LLM


def engine_args(cfg: RolloutConfig, model: ModelConfig, max_prompt_tokens: int, seed: int, *, multi_turn: bool,
                max_new_tokens: int | None, lora: LoraConfig | None, on_gpu: bool, sleep_mode: bool,
                in_process_group: bool) -> dict[str, Any]:
    """The keyword arguments of the worker's `vllm.LLM`. `max_new_tokens`: the longest turn it must hold (an
    evaluation's), else `rollout.sampling.max_new_tokens`; `in_process_group`: the engine of a hybrid actor, built
    inside the learners' process group (the worker sets RANK and LOCAL_RANK, which the external launcher reads)."""
    args: dict[str, Any] = dict(
        model=resolve_model_path(model),
        tokenizer=tokenizer_path(model),
        trust_remote_code=model.trust_remote_code,
        dtype=cfg.dtype,
        seed=seed,
        # One-turn episodes need the longest prompt and turn (`max_new_tokens`: an evaluation's may be longer
        # than training's); multi-turn ones, the model's own context.
        max_model_len=cfg.max_model_len or (None if multi_turn else
                                            max_prompt_tokens + (max_new_tokens or cfg.sampling.max_new_tokens)),
        enforce_eager=cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=True,
        # distrl's methods in every worker process: weight loads, fingerprints, adapters, NCCL (called by name).
        worker_extension_cls=WORKER_EXTENSION,
    )
    if cfg.tensor_parallel_size > 1:
        # One engine over k worker processes, the engine core kept in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        # beside them: vLLM's multiprocess executor, never Ray's (vLLM would pick it inside a Ray actor).
        args.update(distributed_executor_backend="mp", enable_expert_parallel=cfg.expert_parallel)
    if cfg.routing_replay:
        # Every request's routes come back with its output (`Sampled.routes`); vLLM serves them from its Model
        # Runner V2, on GPUs (it refuses the flag where it would take the V1 runner).
        args["enable_return_routed_experts"] = True
    if lora is not None:
        # One slot: the current version's adapters, which every request carries.
        args.update(enable_lora=True, max_lora_rank=lora.rank, max_loras=1)
    if on_gpu:
        # sleep_mode: a hybrid actor's engine releases the GPU while its learner works (`sleep`, `wake_up`).
        args.update(gpu_memory_utilization=cfg.gpu_memory_utilization, enable_sleep_mode=sleep_mode)
    else:
        # Chunked prefill off: when it splits a prompt, vLLM rewinds the request's seeded generator with
        # set_offset, which CPU generators do not have ("CPU Generator does not use offset"), so a step whose
        # prompts pass the token budget (4096) would crash. Whole prompts are scheduled instead.
        args.update(kv_cache_memory_bytes=cfg.kv_cache_bytes, enable_chunked_prefill=False)
        if cfg.tensor_parallel_size == 1:
            args["distributed_executor_backend"] = "uni"
    if in_process_group:
        # A hybrid actor's engine, built once its learner joined the learners' process group: vLLM would make
        # its own world group the process's default one, which the learners' already is. With the external
        # launcher it takes the existing group as its world instead (as many data-parallel replicas of a TP 1
        # engine, each serving its own requests: no collective while serving) and makes its model-parallel
        # groups inside it, a collective that every learner makes at once. It reads its rank from RANK.
        args["distributed_executor_backend"] = "external_launcher"
    return args


def worker_threads(cfg: RolloutConfig) -> int | None:
    """On CPU, the compute threads of each worker process of a tensor-parallel engine: the actor's
    (OMP_NUM_THREADS) split among its k workers, at least one each; None at TP 1 (the engine's one worker runs in
    the actor's process, with its threads)."""
    if cfg.tensor_parallel_size == 1:
        return None
    return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")) // cfg.tensor_parallel_size)


def warm_up(llm: Any) -> None:
    """Two tokens of one request sampled as the runs sample (seeded, with log-probs), before the engine serves:
    vLLM compiles (torch.compile, dynamo) its count of each sampled token's rank at the first request that asks for
    log-probs, about 3 s on a CPU core, which the run's first step paid in its generation (measured on the
    quickstart's engine with cProfile: the first request with log-probs 2.8 s, all in dynamo; the next ones 0.01 s,
    whatever their batch size). The request's own seed leaves the engine's random state as it was. Call it on the
    engine's thread."""
    from vllm import SamplingParams

    llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=2, temperature=1.0, seed=0, logprobs=0),
                 use_tqdm=False)
