"""The one typed config tree.

Validated once at the boundary (`load`), then handed down in slices: each component receives only its own section
(`cfg.loss`, `cfg.rollout`, ...). Every model forbids unknown keys so that a typo is an error, not a silent default.
Cross-field checks live on `Config` and name every field they involve.

This module imports only Pydantic and PyYAML: `distrl validate` and `distrl --help` must stay light.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from distrl.config_sources import ConfigError, Origins, apply_override, format_validation_error, yaml_origins

__all__ = [
    "AlgorithmConfig",
    "AsyncLoop",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "CorrectionConfig",
    "DataConfig",
    "DynamicSamplingConfig",
    "KLConfig",
    "LearnerConfig",
    "LossConfig",
    "ModelConfig",
    "ReferenceConfig",
    "RewardConfig",
    "RoleResources",
    "RolloutConfig",
    "RunConfig",
    "SamplingConfig",
    "SyncLoop",
    "load",
]

Dtype = Literal["float32", "bfloat16", "float16"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"]
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
# One plain path component: no separators, and no leading dot, so never `.`, `..` or a hidden directory.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are re-validated, docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


# --------------------------------------------------------------------------------------------------- model & data
class ModelConfig(Section):
    path: str = Field(min_length=1)
    """Local directory or hub name of the policy model (HF format). The learner trains it, vLLM serves it."""
    tokenizer: str | None = None
    """Tokenizer location; null means the model path."""
    trust_remote_code: bool = False
    """Passed to transformers and vLLM when loading the model and tokenizer."""
    create_tiny_if_missing: bool = False
    """Build distrl's tiny random test model at `path` when nothing is there (seeded, so every node that needs it
    builds identical weights). For the quickstart and tests, where no hub is reachable; never set it for real runs."""


class DataConfig(Section):
    path: str = Field(min_length=1)
    """Prompt file: `.jsonl`, `.parquet`, or a `datasets` directory saved with `save_to_disk`."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages `{role, content}`."""
    answer_key: str | None = "answer"
    """Field holding the reference answer handed to the reward function; null when the task has none."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """`auto`: chat messages are rendered with the tokenizer's template, plain strings are used as they are;
    `always`: plain strings are wrapped as one user message and rendered; `never`: messages are an error."""
    max_prompt_tokens: int = Field(default=256, gt=0)
    """Prompts longer than this (in tokens) are dropped at load time and counted."""
    shuffle: bool = True
    """Shuffle the prompt order each epoch, deterministically from `run.seed` and the epoch number."""


# --------------------------------------------------------------------------------------------------------- rollout
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
    """Engine context length; null means max_prompt_tokens + max_new_tokens."""
    tensor_parallel_size: int = Field(default=1, gt=0)
    """vLLM tensor parallelism per rollout actor (GPU only; each actor then needs that many GPUs)."""
    gpu_memory_utilization: float = Field(default=0.5, gt=0.0, le=1.0)
    """Fraction of GPU memory vLLM may take (GPU only)."""
    kv_cache_bytes: int = Field(default=128 * 2**20, gt=0)
    """KV-cache size on CPU, in bytes (vLLM's CPU build cannot infer it)."""
    enforce_eager: bool = True
    """Disable CUDA graphs / compilation: faster start-up, slower decoding."""
    chunk_prompts: int | None = Field(default=None, gt=0)
    """Prompts per generation request to one rollout actor. Engines switch weights between chunks, so smaller
    chunks track new versions sooner; null means prompts_per_step / rollout actors in the synchronous loop (one
    chunk per engine per step) and half that in the asynchronous one, rounded up."""
    dynamic_sampling: DynamicSamplingConfig | None = None
    """DAPO's dynamic sampling: drop groups whose rewards are all equal (no learning signal) and keep generating
    until the batch is full of groups that have one. Null keeps every group."""
    seed: int | None = None
    """Sampling seed of the run. Each prompt's request carries its own seed, derived from this one and the prompt's
    ticket (its place in the run's prompt stream, which counts on across epochs), so a sample does not depend on
    which engine drew it, on the number of engines, on a restart or on a resume. Null: 1000 x `run.seed`."""


class ReferenceConfig(Section):
    path: str | None = None
    """Reference model; null means the initial policy (`model.path`). Created only when a KL term needs it."""
    dtype: Dtype = "float32"
    """Dtype the reference model runs in."""
    micro_batch_size: int = Field(default=8, gt=0)
    """Sequences per reference forward pass (when `max_tokens_per_micro_batch` is null)."""
    max_tokens_per_micro_batch: int | None = Field(default=None, gt=0)
    """Token budget of one reference forward pass: sequences (prompt + response tokens, no padding) are packed by
    first-fit decreasing into micro-batches of at most this many tokens; a longer sequence goes alone. Null: fixed
    micro-batches of `micro_batch_size` sequences."""


# --------------------------------------------------------------------------------------------------------- learner
class LearnerConfig(Section):
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the forward and backward passes. Weights and optimizer state stay float32 either way;
    bfloat16 runs the model under autocast (mixed precision)."""
    lr: float = Field(default=1e-5, gt=0.0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up length in optimizer steps."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """Schedule after warm-up: constant, or cosine decay to `min_lr_ratio * lr` at the last optimizer step."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Floor of the cosine schedule as a fraction of `lr`."""
    max_grad_norm: float | None = Field(default=1.0, gt=0.0)
    """Global gradient-norm clip; null disables clipping (the norm is still measured)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    ppo_epochs: int = Field(default=1, gt=0)
    """Passes over each step's batch."""
    mini_batch_size: int | None = Field(default=None, gt=0)
    """Sequences per optimizer step, across all learners; null means the whole step batch (one step per epoch)."""
    micro_batch_size: int = Field(default=4, gt=0)
    """Sequences per forward/backward pass on one learner (when `max_tokens_per_micro_batch` is null)."""
    max_tokens_per_micro_batch: int | None = Field(default=None, gt=0)
    """Token budget of one forward/backward pass on one learner: sequences (prompt + response tokens, no padding)
    are packed by first-fit decreasing into micro-batches of at most this many tokens; a longer sequence goes
    alone. The loss stays exactly the full mini-batch's (global normalisation), whatever the partition. Null:
    fixed micro-batches of `micro_batch_size` sequences."""
    max_consecutive_nonfinite: int = Field(default=3, gt=0)
    """Optimizer steps with a non-finite loss or grad norm are skipped; this many in a row stop the run."""


# ---------------------------------------------------------------------------------------------------- algo & loss
class AlgorithmConfig(Section):
    model_config = ConfigDict(validate_by_name=True)  # `lambda` in YAML and --set, `lam` in Python

    advantage: AdvantageEstimator = "grpo"
    """Advantage estimator. `gae` needs a value model (critic)."""
    eps: float = Field(default=1e-6, gt=0.0)
    """Added to the standard deviation before dividing (grpo, whitening, reinforce_pp*)."""
    whitening: bool = False
    """Whiten the sequence advantages over the whole step batch after the estimator: subtract the batch mean,
    divide by the batch std (+ eps). reinforce_pp and reinforce_pp_baseline always whiten; dr_grpo with
    whitening is reinforce_pp_baseline."""
    gamma: float = Field(default=1.0, ge=0.0, le=1.0)
    """Discount over response tokens (token-level returns, GAE)."""
    lam: float = Field(default=0.95, ge=0.0, le=1.0, alias="lambda")
    """GAE lambda (`lambda` in YAML and --set; `lam` in Python, as `lambda` is a keyword)."""
    old_logprobs: Literal["recompute", "rollout"] = "recompute"
    """Where the PPO ratio's denominator comes from. `recompute`: the learner scores the batch before updating
    (decoupled PPO; the rollout correction then bridges rollout -> old). `rollout`: use vLLM's log-probs directly
    (bypass mode; cheaper, and the correction weights are then identically 1). When the update is one optimizer
    step (one mini-batch, one PPO epoch) and no KL in the reward needs them first, `recompute` takes them from the
    update's own forward pass, detached: the same weights give the same log-probs, without a second pass."""

    @model_validator(mode="after")
    def _checks(self) -> AlgorithmConfig:
        if self.whitening and self.advantage.startswith("reinforce_pp"):
            raise ValueError(f"algorithm.whitening is redundant with algorithm.advantage '{self.advantage}', which "
                             f"always whitens over the batch; leave whitening false")
        if self.whitening and self.advantage == "gae":
            raise ValueError("algorithm.whitening applies to the sequence-level estimators, not "
                             "algorithm.advantage 'gae'")
        return self


class KLConfig(Section):
    coef: float = Field(default=0.0, ge=0.0)
    """Weight beta of the KL-to-reference term; 0 disables it (and the reference actor)."""
    estimator: Literal["k1", "k2", "k3", "k3+"] = "k3"
    """Per-token estimator of KL(pi || pi_ref) (Schulman 2020); `k3+` is k3's value with k2's gradient."""
    target: Literal["loss", "reward"] = "loss"
    """`loss`: add coef * KL to the loss; `reward`: subtract it from the token rewards before advantages."""


class CorrectionConfig(Section):
    mode: Literal["tis", "icepop", "seq_mask_tis"] = "tis"
    """Importance-sampling correction of the rollout/trainer mismatch (weights from old_logprobs - rollout_logprobs).
    `tis`: truncate the ratio into [low, high]; `icepop`: zero tokens whose ratio leaves [low, high];
    `seq_mask_tis`: zero whole sequences whose geometric-mean ratio leaves [low, high]."""
    level: Literal["token", "sequence"] = "token"
    """`sequence` uses the per-sequence product ratio for tis/icepop. seq_mask_tis is sequence-masked by
    construction and takes `token` only."""
    low: float = Field(default=0.0, ge=0.0)
    """Lower bound of the ratio (0 gives TIS's one-sided cap)."""
    high: float = Field(default=2.0, gt=0.0)
    """Upper bound of the ratio."""

    @model_validator(mode="after")
    def _bounds(self) -> CorrectionConfig:
        if not self.low < self.high:
            raise ValueError(f"loss.correction.low ({self.low}) must be < loss.correction.high ({self.high})")
        if self.mode == "seq_mask_tis" and self.level != "token":
            raise ValueError("loss.correction.level must be 'token' with loss.correction.mode 'seq_mask_tis' "
                             "(the mode already masks whole sequences)")
        return self


class LossConfig(Section):
    policy: Literal["ppo", "gspo"] = "ppo"
    """Per-token PPO ratio, or GSPO's per-sequence length-normalised ratio."""
    clip_low: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Ratio is clipped below at 1 - clip_low."""
    clip_high: float = Field(default=0.2, ge=0.0)
    """Ratio is clipped above at 1 + clip_high (DAPO's clip-higher sets it above clip_low)."""
    dual_clip: float | None = None
    """Dual-clip constant c > 1: for A < 0 the per-token loss is capped at -c A (Ye et al. 2020). Null disables."""
    aggregation: Aggregation = "token_mean"
    """How per-token terms become one scalar: token_mean (DAPO), seq_mean_token_mean (GRPO), seq_mean_token_sum,
    seq_mean_token_sum_norm (Dr. GRPO: per-sequence sums over a constant `norm_len`)."""
    norm_len: int | None = Field(default=None, gt=0)
    """Constant divisor of seq_mean_token_sum_norm; null means the padded response length
    (`rollout.sampling.max_new_tokens` in training)."""
    entropy_coef: float = Field(default=0.0, ge=0.0)
    """Weight of the entropy bonus (subtracted from the loss)."""
    kl: KLConfig = Field(default_factory=KLConfig)
    """KL to the reference model."""
    correction: CorrectionConfig | None = None
    """Rollout/trainer importance-sampling correction; null disables it."""

    @model_validator(mode="after")
    def _checks(self) -> LossConfig:
        if self.dual_clip is not None and not self.dual_clip > 1.0:
            raise ValueError(f"loss.dual_clip must be > 1 (got {self.dual_clip}); null disables it")
        # GSPO's objective is the mean over sequences of one clipped term each; every other mode weights a
        # sequence by its length (token_mean, seq_mean_token_sum, and _norm's sum over a constant).
        if self.policy == "gspo" and self.aggregation != "seq_mean_token_mean":
            raise ValueError(f"loss.policy 'gspo' is sequence-level and cannot use loss.aggregation "
                             f"'{self.aggregation}', which weights each sequence by its length; use "
                             f"seq_mean_token_mean")
        return self


# --------------------------------------------------------------------------------------------------------- rewards
class RewardConfig(Section):
    function: str = "distrl.workers.rewards:exact_match"
    """Reward function `package.module:function` with signature (prompt, completion, sample) -> float."""
    on_error: Literal["raise", "zero"] = "raise"
    """A reward function that raises or returns a non-finite or non-numeric value fails the run (`raise`, naming
    the function and the sample) or scores that sample 0 and counts it in `reward/errors` (`zero`)."""
    max_error_frac: float = Field(default=0.5, gt=0.0, le=1.0)
    """With `on_error: zero`, a step in which more than this fraction of the samples failed stops the run with the
    last error: the function is broken, and training on zeros would only hide it (1.0: never stop)."""
    num_cpus: float = Field(default=0.25, gt=0.0)
    """CPUs reserved by each reward task."""
    batch_per_task: int = Field(default=64, gt=0)
    """Samples scored per Ray task."""
    max_retries: int = Field(default=3, ge=0)
    """Times a reward task is run again when its process dies (killed, out of memory, node lost). An exception
    raised by the reward function is not an infrastructure failure: `on_error` decides what happens to it."""


# --------------------------------------------------------------------------------------------------------- cluster
class RoleResources(Section):
    num_actors: int = Field(default=1, gt=0)
    """Actors in this role."""
    num_cpus: float = Field(default=1.0, gt=0.0)
    """CPUs reserved per actor."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs reserved per actor (0 on a CPU-only machine)."""
    num_threads: int | None = Field(default=None, gt=0)
    """Compute threads per actor (OMP_NUM_THREADS, which torch and vLLM's CPU kernels follow). Null: num_cpus
    rounded up, except in the synchronous loop on the embedded cluster, where the roles take turns and each may use
    every core (shared among the actors that run at the same time; see `distrl.cluster.roles.role_threads`)."""


class RecoveryConfig(Section):
    max_restarts: int = Field(default=3, ge=0)
    """Times one rollout actor may be replaced within `window_s` when it dies (process killed, node lost): its
    prompts are re-dispatched and the new actor serves the current weights before it takes any. One more death in
    the window ends the run, naming the actor and its last error. 0: a dead rollout actor ends the run."""
    window_s: float = Field(default=3600.0, gt=0.0)
    """Seconds over which `max_restarts` is counted."""
    start_timeout_s: float = Field(default=900.0, gt=0.0)
    """A replacement that does not serve this many seconds after it was started ends the run, naming it: its
    placement bundle may have no node left to run on, or its engine hangs while starting."""
    max_recoveries: int = Field(default=2, ge=0)
    """Times the run may recover from its newest checkpoint when a learner or reference actor dies (every role is
    started again; the steps after the checkpoint are redone). Needs checkpoints (`run.checkpoint_every`);
    0: such a death ends the run."""


class ClusterConfig(Section):
    backend: Literal["ray", "local"] = "ray"
    """`ray`: every role in Ray actors. `local`: every role as a plain object in the driver's process (one
    learner, no Ray): the same loop, for fast tests and stepping through in a debugger, not for training runs."""
    address: str | None = None
    """Ray address: null starts an embedded local cluster (or joins the one `RAY_ADDRESS` names, as in a Ray job);
    `auto`, `ray://host:port` or `host:port` join an existing one."""
    dashboard_host: str = "127.0.0.1"
    """Interface of the embedded cluster's dashboard. Keep it on loopback unless the network is trusted."""
    num_cpus: int | None = Field(default=None, gt=0)
    """CPUs the embedded cluster advertises; null means all of this machine's."""
    rollout: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=1.0))
    """Rollout (vLLM) actors."""
    learner: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=1.0))
    """Learner actors (data-parallel)."""
    reference: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.5))
    """Reference actors."""
    colocate: bool = False
    """Pack all roles into one placement group (PACK over the whole job) instead of one group per role."""
    weight_sync: Literal["auto", "object_store", "nccl"] = "auto"
    """Learner -> rollout weight transport: `auto` is nccl when learners and rollout actors have GPUs, else the
    Ray object store."""
    sync_bucket_bytes: int = Field(default=64 * 2**20, gt=0)
    """Weights travel in buckets of about this many bytes."""
    sync_timeout_s: float = Field(default=1800.0, gt=0.0)
    """A weight push that has not reached every engine this many seconds after it started ends the run with an
    error naming the engines (and, with NCCL, learner 0's broadcast) instead of waiting for ever: a hung engine, or a
    collective waiting for a dead peer. In the asynchronous loop a push waits behind the chunk each engine runs."""
    call_timeout_s: float = Field(default=3600.0, gt=0.0)
    """An actor call or task that has not returned this many seconds after it was sent (a generation chunk, a reward
    task, an update or log-prob pass, a checkpoint) ends the run with an error naming the actor and the call, instead
    of a wait without end on a hung actor or a collective whose peer hangs. Set it above the longest such call."""
    verify_weights: bool = True
    """After every weight push, each engine checks a fingerprint of the weights it serves (every row of every tensor
    at a fixed sample of columns, read through its own kernels) against learner 0's, and a mismatch ends the run
    naming the engine and the first tensor that differs. Adds about a third of the reload to a push
    (bench/bench_fingerprint.py)."""
    actor_env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for every actor."""
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    """What the run does when an actor dies: rollout actors are replaced, learners and reference recovered from a
    checkpoint."""


# ------------------------------------------------------------------------------------------------------------ loop
class SyncLoop(Section):
    mode: Literal["sync"] = "sync"
    """Generation and training alternate: every sample is generated by the weights it is trained from (staleness
    0, on-policy up to the rollout/trainer mismatch)."""


class AsyncLoop(Section):
    mode: Literal["async"]
    """Producers and learners run at once: rollout actors keep generating while the learners update."""
    max_staleness: int = Field(default=1, ge=1)
    """k: a sample generated by policy version v is trained only in an update that starts from version u with
    u - v <= k. k = 1 is one-step-off-policy (the next batch is generated while the current one trains)."""


Loop = Annotated[SyncLoop | AsyncLoop, Field(discriminator="mode")]


# ------------------------------------------------------------------------------------------------------------- run
class RunConfig(Section):
    name: str = "run"
    """Run name: the run directory is output_dir/name. One plain directory name: letters, digits, `_`, `-` and `.`,
    not starting with `.` or `-`."""
    output_dir: str = "runs"
    """Parent of run directories."""
    steps: int = Field(default=10, gt=0)
    """Training steps (one step = generate, score, update, sync)."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    log_every: int = Field(default=1, gt=0)
    """Print a progress line every this many steps (metrics files get every step)."""
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard."""
    ray_metrics: bool = True
    """Export every step's figures as Ray metrics (dashboard metrics view)."""
    progress: bool = True
    """Show a progress bar."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every this many steps (0: only at the end if `checkpoint_at_end`)."""
    checkpoint_at_end: bool = True
    """Save a checkpoint after the last step, so that a finished run can be continued (`resume` with more
    `steps`) or its policy used."""
    keep_checkpoints: int | None = Field(default=None, ge=1)
    """Keep only the newest this many checkpoints (null keeps every one). Each save deletes the older ones after
    the new one is complete, so a resume always has one to fall back to."""
    resume: bool = False
    """Continue from the newest usable checkpoint in the run directory (metrics after its step are dropped; a newer
    checkpoint that fails its manifest check is named and skipped). With no checkpoint there, the run starts at
    step 1."""
    overwrite: bool = False
    """Start afresh in a run directory that already holds a run, deleting what distrl wrote there (config.yaml,
    metrics.jsonl, tensorboard/, checkpoints/; any other file stays). Without it (or `resume`), such a directory is
    an error, so two runs never mix their files. With `resume` as well, a directory that holds a checkpoint is
    resumed and only one without is started afresh (so `--set run.resume=true` continues the quickstart, which sets
    `overwrite`)."""

    @field_validator("name")
    @classmethod
    def _one_directory_name(cls, name: str) -> str:
        # The name is joined to output_dir and the result may be deleted from (run.overwrite): `..` or `a/b` would
        # point outside output_dir/.
        if not RUN_NAME.fullmatch(name):
            raise ValueError(f"run.name {name!r} must be one plain directory name: letters, digits, '_', '-' and "
                             f"'.', not starting with '.' or '-' (it names a directory inside output_dir)")
        return name


# ------------------------------------------------------------------------------------------------------------ root
class Config(Section):
    model: ModelConfig
    """Policy model."""
    data: DataConfig
    """Prompt data."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """vLLM generation."""
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig)
    """Reference model for the KL term."""
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    """Optimisation."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimation and the source of old log-probs."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Policy loss."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward function."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Actor counts, resources and placement."""
    loop: Loop = Field(default_factory=SyncLoop)
    """Synchronous (`mode: sync`) or asynchronous (`mode: async`, `max_staleness: k`) training loop."""
    run: RunConfig = Field(default_factory=RunConfig)
    """Steps, seed, outputs."""

    @property
    def global_batch_size(self) -> int:
        """Sequences per step: prompts_per_step x n_samples_per_prompt."""
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimizer step (the whole batch when `learner.mini_batch_size` is null)."""
        return self.learner.mini_batch_size or self.global_batch_size

    @property
    def old_logprobs_in_update(self) -> bool:
        """Whether the learners take the old log-probs from the update's own forward pass (see
        `algorithm.old_logprobs`): the update is a single optimizer step from the proximal policy, and nothing needs
        the old log-probs before it (KL in the reward does)."""
        return (self.algorithm.old_logprobs == "recompute" and self.learner.ppo_epochs == 1
                and self.mini_batch_size == self.global_batch_size
                and not (self.loss.kl.target == "reward" and self.loss.kl.coef > 0))

    @property
    def needs_reference(self) -> bool:
        """Whether a reference actor must exist (a KL term with a non-zero coefficient)."""
        return self.loss.kl.coef > 0.0

    @property
    def max_staleness(self) -> int:
        """k of the loop: 0 for the synchronous loop."""
        return self.loop.max_staleness if isinstance(self.loop, AsyncLoop) else 0

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:  # noqa: PLR0912 - one flat list of independent checks, each one branch
        errors: list[str] = []
        bypass = self.algorithm.old_logprobs == "rollout"
        if isinstance(self.loop, AsyncLoop) and bypass and self.loss.correction is None:
            errors.append("loop.mode 'async' with algorithm.old_logprobs 'rollout' and no loss.correction trains on "
                          "stale samples as if they were on-policy (the combination AReaL shows to collapse): use "
                          "algorithm.old_logprobs 'recompute', whose correction (e.g. loss.correction.mode tis) "
                          "bridges the behaviour policy to the proximal one")
        if self.cluster.backend == "local" and self.cluster.learner.num_actors > 1:
            errors.append(f"cluster.backend 'local' runs one learner in the driver's process; "
                          f"cluster.learner.num_actors is {self.cluster.learner.num_actors}")
        if self.cluster.backend == "local" and self.cluster.weight_sync == "nccl":
            errors.append("cluster.weight_sync 'nccl' needs Ray actors on GPUs; cluster.backend is 'local'")
        adv = self.algorithm.advantage
        g = self.rollout.n_samples_per_prompt
        if adv in GROUP_ESTIMATORS and g < 2:
            errors.append(f"algorithm.advantage '{adv}' compares samples within a group and needs "
                          f"rollout.n_samples_per_prompt >= 2 (got {g})")
        if adv == "gae":
            errors.append("algorithm.advantage 'gae' needs a value model (critic), which distrl's driver does not "
                          "train yet; use grpo, dr_grpo, rloo, reinforce_pp or reinforce_pp_baseline")
        batch, mini = self.global_batch_size, self.mini_batch_size
        learners, micro = self.cluster.learner.num_actors, self.learner.micro_batch_size
        if batch % mini:
            errors.append(f"rollout.prompts_per_step x rollout.n_samples_per_prompt ({batch}) must be divisible by "
                          f"learner.mini_batch_size ({mini})")
        if self.learner.max_tokens_per_micro_batch is not None:
            if mini % learners:  # micro-batches come from the token budget: only the shards must be equal
                errors.append(f"learner.mini_batch_size ({mini}) must be divisible by cluster.learner.num_actors "
                              f"({learners})")
        elif mini % (learners * micro):
            errors.append(f"learner.mini_batch_size ({mini}) must be divisible by cluster.learner.num_actors "
                          f"({learners}) x learner.micro_batch_size ({micro})")
        if self.loss.kl.target == "reward" and self.loss.kl.estimator == "k3+":
            errors.append("loss.kl.estimator 'k3+' only changes gradients and has no meaning with "
                          "loss.kl.target 'reward'; use k1, k2 or k3")
        if self.algorithm.old_logprobs == "rollout" and self.loss.correction is not None:
            errors.append("loss.correction needs algorithm.old_logprobs 'recompute': with 'rollout' the old and "
                          "rollout log-probs are the same and every weight would be 1")
        if self.rollout.max_model_len is not None and (
            self.rollout.max_model_len < self.data.max_prompt_tokens + self.rollout.sampling.max_new_tokens
        ):
            errors.append(f"rollout.max_model_len ({self.rollout.max_model_len}) must be >= data.max_prompt_tokens "
                          f"+ rollout.sampling.max_new_tokens "
                          f"({self.data.max_prompt_tokens + self.rollout.sampling.max_new_tokens})")
        if self.rollout.tensor_parallel_size > 1:
            errors.append(f"rollout.tensor_parallel_size ({self.rollout.tensor_parallel_size}) > 1 is not supported "
                          "yet: in-place weight updates need the engine inside the rollout actor's process; scale "
                          "with cluster.rollout.num_actors instead")
        s = self.rollout.sampling
        if self.algorithm.old_logprobs == "rollout" and (s.top_p < 1.0 or s.top_k > 0):
            errors.append("algorithm.old_logprobs 'rollout' with rollout.sampling.top_p < 1 or "
                          "rollout.sampling.top_k > 0 would take the truncated sampler's log-probs as the old "
                          "policy (biased ratios from the first step); use 'recompute'")
        if self.cluster.weight_sync == "nccl" and (
            self.cluster.learner.num_gpus == 0 or self.cluster.rollout.num_gpus == 0
        ):
            errors.append("cluster.weight_sync 'nccl' needs GPUs on both cluster.learner.num_gpus and "
                          "cluster.rollout.num_gpus")
        if self.cluster.num_cpus is not None and self.cluster.address is None:
            problem = self.unplaceable(self.cluster.num_cpus, "cluster.num_cpus", "num_cpus")
            if problem:
                errors.append(problem)
        if errors:
            raise ValueError("\n".join(errors))
        return self

    def unplaceable(self, have: float, what: str, resource: str) -> str | None:
        """Why the roles' `resource` (num_cpus or num_gpus) cannot fit in the `have` of one node (`what` names
        where that figure comes from), or None. A reward task needs reward.num_cpus besides the actors."""
        roles = [("rollout", self.cluster.rollout), ("learner", self.cluster.learner)]
        if self.needs_reference:
            roles.append(("reference", self.cluster.reference))
        reward = self.reward.num_cpus if resource == "num_cpus" else 0.0
        demand = sum(r.num_actors * getattr(r, resource) for _, r in roles) + reward
        if demand <= have + 1e-9:
            return None
        parts = " + ".join(f"cluster.{n}.num_actors x {resource} ({r.num_actors} x {getattr(r, resource)})"
                           for n, r in roles if getattr(r, resource))
        tail = f" and a reward task needs reward.num_cpus ({reward})" if reward else ""
        return f"the embedded cluster has {what} = {have:g} but the actors reserve {parts}{tail}: {demand:g} in all"


# ------------------------------------------------------------------------------------------------------- loading
def from_dict(tree: dict[str, Any], source: str = "<config>", origins: Origins | None = None) -> Config:
    """Validate a raw mapping; raise ConfigError listing every bad field path."""
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        lines = format_validation_error(err, origins)
        head = f"invalid config {source}: {len(lines)} problem{'s' if len(lines) > 1 else ''}"
        raise ConfigError("\n".join([head, *lines])) from None


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, apply `key=value` overrides in order, validate.

    Relative paths inside the file (model.path, data.path, ...) are kept as written: they resolve against the
    working directory, as a Ray job's `--working-dir` expects.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        tree = yaml.safe_load(text) or {}
        origins = yaml_origins(text, str(path))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}")
    for override in overrides:
        apply_override(tree, override, origins)
    return from_dict(tree, source=str(path), origins=origins)


def to_yaml(cfg: Config) -> str:
    """The resolved config, every default filled in, as YAML."""
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
