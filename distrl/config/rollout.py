"""`rollout`: how vLLM generates (batch sizes, sampling, engine settings, DAPO's dynamic sampling)."""

from __future__ import annotations

from pydantic import Field

from distrl.config.base import Dtype, Section


class SamplingConfig(Section):
    temperature: float = Field(default=1.0, gt=0.0)
    """Sampling temperature. The learner and reference divide logits by the same value, so that their log-probs
    describe the distribution the sampler drew from."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass. Values below 1 make the sampler's distribution differ from the trained one."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k truncation; -1 disables it."""
    max_new_tokens: int = Field(default=64, gt=0)
    """Maximum response length in tokens."""
    stop: list[str] = Field(default_factory=list)
    """Stop strings; the response ends before them."""


class DynamicSamplingConfig(Section):
    max_rounds: int = Field(default=3, gt=0)
    """Cap on generation per batch: once the groups filtered out since the last batch add up to
    (max_rounds - 1) x rollout.prompts_per_step, filtering pauses and the batch is completed with the next groups
    whatever their rewards (counted in dynamic_sampling/cap_reached), so a hard stretch of data never stalls a run."""


class RolloutConfig(Section):
    prompts_per_step: int = Field(default=8, gt=0)
    """Prompts drawn per training step (P). The global batch is P x n_samples_per_prompt sequences."""
    n_samples_per_prompt: int = Field(default=4, gt=0)
    """Responses sampled per prompt (the group size G of group-relative estimators)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """How responses are sampled."""
    dtype: Dtype = "bfloat16"
    """Engine dtype. A dtype lower than the learner's creates the rollout/trainer mismatch that `loss.correction`
    corrects."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Engine context length; null means data.max_prompt_tokens + sampling.max_new_tokens, or with an `env` section
    (multi-turn episodes) the model's own context length."""
    tensor_parallel_size: int = Field(default=1, gt=0)
    """Worker processes of each rollout actor's engine (vLLM tensor parallelism, k): one engine serves the model
    split k ways, so a model (and its KV cache) too big for one device fits on k. On GPUs each actor reserves its k
    devices on one node (`cluster.rollout.num_gpus` = k); on CPU its k workers share its threads. Pushes reach every
    worker, each taking only its slice, and each worker's weights are checked."""
    expert_parallel: bool = False
    """Mixture-of-experts policies: spread whole experts over the engine's k workers (vLLM's expert parallelism)
    instead of cutting every expert k ways. Needs tensor_parallel_size > 1 and engines on GPUs (vLLM's CPU build
    crashes in its fused-MoE kernel with it)."""
    routing_replay: bool = False
    """Rollout routing replay (R3) for mixture-of-experts policies: the engines return the experts each MoE layer
    routed every token to (vLLM's `enable_return_routed_experts`, 1 byte per layer and expert slot up to 256
    experts), carried with the samples to the learners and the reference, whose forward passes then route each
    token to those experts, weighted by the current router's softmax over them (the routers still learn). Removes
    the largest source of rollout/trainer mismatch of a MoE. Needs engines on GPUs (vLLM returns routes only from
    its Model Runner V2, which needs Triton) and a MoE model; tokens the engine gave no route (a sample's last token)
    are routed by the learner's own routers."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    kv_cache_bytes: int = Field(default=128 * 2**20, gt=0)
    """KV-cache size on CPU, in bytes (vLLM's CPU build cannot infer it)."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation: faster start-up, slower decoding. Left out, it is false when the engines
    have GPUs (`cluster.rollout.num_gpus` > 0), else true."""
    chunk_prompts: int | None = Field(default=None, gt=0)
    """Prompts per generation request to one rollout actor. Engines switch weights between chunks, so smaller
    chunks track new versions sooner; null means prompts_per_step / rollout actors in the synchronous loop (one
    chunk per engine per step) and half that in the asynchronous one, rounded up."""
    chunks_per_engine: int | None = Field(default=None, gt=0)
    """Generation requests (chunks) one engine serves at once. Above 1 the episodes of several chunks share the
    engine, so episodes waiting on their environment leave it to the others, and a weight push lands between two
    engine steps instead of after the chunk in flight: turns in flight go on with the new weights, each token
    stamped with the version that sampled it. Null: 1 without an `env` section or in hybrid mode (`cluster.colocate:
    hybrid`, where it must be 1: a hybrid actor runs one call at a time), 4 with one."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no learning signal) and keep generating
    until the batch is full of groups that have one. Null keeps every group."""
    seed: int | None = None
    """Sampling seed of the run. Each prompt's request carries its own seed, derived from this one and the prompt's
    ticket (its place in the run's prompt stream, which counts on across epochs), so a sample does not depend on
    which engine drew it, on the number of engines, on a restart or on a resume. Null: 1000 x `run.seed`."""
