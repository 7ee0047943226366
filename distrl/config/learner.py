"""`learner` (optimisation, with the learning-rate schedule as a union: constant or cosine) and `reference`."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from distrl.config.base import Dtype, Section, Variants, refuse_moved

TokenBudget = Annotated[int, Field(gt=0)] | Literal["auto"] | None
"""A micro-batch token budget: a number of tokens, `auto` (from the device's memory and the model), or null."""

Kernels = Literal["plain", "liger", "compile"]
"""`learner.kernels`, `critic.kernels`, `reference.kernels` (`distrl.workers.training.kernels`)."""


class ConstantSchedule(Section):
    type: Literal["constant"] = "constant"
    """The learning rate stays at `learner.lr` after warm-up."""


class CosineSchedule(Section):
    type: Literal["cosine"] = "cosine"
    """Cosine decay after warm-up, from `learner.lr` to `min_lr_ratio * lr` at the last optimizer step."""
    min_lr_ratio: float = Field(default=0.0, ge=0.0, le=1.0)
    """Floor of the cosine schedule as a fraction of `learner.lr`."""


LR_SCHEDULE = Variants("type", "constant", {"constant": ConstantSchedule, "cosine": CosineSchedule})
LRSchedule = Annotated[ConstantSchedule | CosineSchedule, Field(discriminator="type"), LR_SCHEDULE.shorthand]
"""`learner.lr_schedule: cosine` is shorthand for `{type: cosine}` (min_lr_ratio 0)."""


class ReplicateStrategy(Section):
    type: Literal["replicate"] = "replicate"
    """Every learner holds the whole model and its AdamW state (~16 bytes per parameter); gradients are summed
    across learners with all-reduce."""


class FSDPStrategy(Section):
    type: Literal["fsdp"] = "fsdp"
    """FSDP2: parameters, gradients and AdamW state are sharded across the learners (one unit per decoder layer),
    so each holds ~1/M of them; the model is built on the meta device and each learner reads only its slices of
    the files. Forward passes are collectives: the learners score and train in lockstep, on equal shards."""
    cpu_offload: bool = False
    """Keep the sharded parameters, gradients and AdamW state in CPU memory, copied to the GPU for each layer's
    forward and backward (for models whose shards do not fit next to the activations)."""


STRATEGY = Variants("type", "replicate", {"replicate": ReplicateStrategy, "fsdp": FSDPStrategy})
Strategy = Annotated[ReplicateStrategy | FSDPStrategy, Field(discriminator="type"), STRATEGY.shorthand]
"""`learner.strategy: fsdp` is shorthand for `{type: fsdp}` (no CPU offload)."""


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's `max_lora_rank` accepts (vLLM 0.32's LoRAConfig refuses any other, e.g. 4): the engines are
started with `max_lora_rank = learner.lora.rank`."""

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF projection names whose adapters vLLM serves and whose served weights the push check reads back: vLLM packs
q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, any subset of each pack included (measured against HF+PEFT
to 1e-6 in fp32 on Llama and Qwen2)."""


class LoraConfig(Section):
    """Low-rank adapters (LoRA, Hu et al. 2021) on the policy's projections, trained through `peft`: W + (alpha/r) B A
    with A `[r, in]` (random) and B `[out, r]` (zeros at the start, so the first policy is the base model). Only A and
    B train; the base weights stay frozen, in `learner.dtype` (under `strategy: fsdp`, sharded over the learners in
    float32, the adapters replicated). The reference of a KL term is the base model itself
    (the adapters disabled, on the learners: no reference actor), checkpoints hold the adapters in PEFT's format, and
    pushes send either the adapters, which the engines serve through vLLM's LoRA support, or the adapted projections
    merged into their base weights, which the engines serve as plain weights (`serve`)."""

    rank: int = 8
    """r, the adapters' rank: one of vLLM's `max_lora_rank` values (1, 8, 16, 32, 64, 128, 256, 320, 512)."""
    alpha: float = Field(default=16.0, gt=0.0)
    """The adapters' scale numerator: the update is (alpha / rank) B A."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (not when scoring: old, reference and rollout log-probs are
    without it)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_MODULES), min_length=1)
    """The projections that get adapters, by their HF names (every layer's): a subset of q_proj, k_proj, v_proj,
    o_proj, gate_proj, up_proj, down_proj. On a mixture of experts, gate_proj, up_proj and down_proj also name the
    experts' projections, which transformers holds fused as parameters (`mlp.experts.gate_up_proj` `[E, 2I, H]`,
    `down_proj` `[E, H, I]`) and peft adapts through its `target_parameters` (one adapter of rank r per expert):
    gate_proj and up_proj then come together (their experts' weights are one tensor), the adapters are served
    merged (`serve: merged`) and take no dropout (peft cannot apply it to a parameter's adapter)."""
    serve: Literal["adapters", "merged"] = "adapters"
    """How the engines serve the adapters. `adapters`: each push sends A and B (megabytes), which the engines
    register through vLLM's LoRA support (`enable_lora`) over the base they loaded from `model.path`. `merged`: each
    push sends W + (alpha/r) B A of every adapted projection (and the rest of its attention or MLP block, which vLLM
    loads as one layer), and the engines, started without LoRA support, serve plain weights, checked tensor by tensor
    like a full push; the rest of the model is the base the engines loaded from `model.path`, which is frozen. For
    engines without LoRA support for the model (vLLM's CPU build on a mixture of experts) and for adapters on a
    mixture of experts' experts."""

    @model_validator(mode="after")
    def _servable(self) -> LoraConfig:
        if self.rank not in LORA_RANKS:
            raise ValueError(f"learner.lora.rank {self.rank} is not a rank vLLM serves (its max_lora_rank must be "
                             f"one of {', '.join(map(str, LORA_RANKS))})")
        unknown = [m for m in self.target_modules if m not in LORA_MODULES]
        if unknown:
            raise ValueError(f"learner.lora.target_modules {unknown}: not projections whose adapters distrl pushes "
                             f"to vLLM and checks there; choose among {', '.join(LORA_MODULES)}")
        if len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError(f"learner.lora.target_modules {self.target_modules} names a module twice")
        return self

    @property
    def scaling(self) -> float:
        """alpha / r: what peft multiplies B A by, and what vLLM folds into B when it loads an adapter."""
        return self.alpha / self.rank


class LearnerConfig(Section):
    SECTION: ClassVar[str] = "learner"
    strategy: Strategy = Field(default_factory=ReplicateStrategy)
    """How the learners hold the model: `replicate` (a full copy each) or `fsdp` (sharded, with optional
    `cpu_offload`)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Compute dtype of the forward and backward passes. Weights and optimizer state stay float32 either way;
    bfloat16 casts the float32 weights to bfloat16 once per forward pass, layer by layer, and runs the whole pass in
    bfloat16 (mixed precision; gradients reach the float32 weights through the casts). Left out, it is bfloat16 when
    the role has GPUs (`cluster.learner.num_gpus`, `cluster.critic.num_gpus` > 0), else float32."""
    lr: float = Field(default=1e-5, gt=0.0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(default=0.0, ge=0.0)
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warm-up length in optimizer steps."""
    lr_schedule: LRSchedule = Field(default_factory=ConstantSchedule)
    """Schedule after warm-up: `constant`, or `{type: cosine, min_lr_ratio: r}` (decay to r * lr)."""
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
    max_tokens_per_micro_batch: TokenBudget = None
    """Token budget of one forward/backward pass on one learner: sequences (prompt + response tokens, no padding)
    go into as few micro-batches of at most this many tokens as first-fit decreasing finds, balanced longest first
    (a longer sequence goes alone). The loss stays exactly the full mini-batch's (global normalisation), whatever
    the partition. `auto`: the most tokens whose activations fit in the GPU's free memory beside the weights,
    gradients and AdamW state, from the model's shape (`distrl.workers.training.token_budget`; 8192 on the CPU), k
    times that with `sequence_parallel_size` k (each learner then holds 1/k of a micro-batch's tokens; a number set
    here counts the whole micro-batch's). Null: fixed micro-batches of `micro_batch_size` sequences. Left out with
    `micro_batch_size` left out too, it is `auto` when the role has GPUs."""
    kernels: Kernels = "plain"
    """Kernels for the model's elementwise work (`distrl.workers.training.kernels`): `plain` (transformers' modules),
    `liger` (liger-kernel's fused RMSNorm, rotary embedding and SwiGLU; the `kernels` extra) or `compile`
    (`torch.compile` of each decoder layer). `liger` and `compile` need a GPU. Left out, it is `liger` when the role
    has GPUs."""
    max_consecutive_nonfinite: int = Field(default=3, gt=0)
    """Optimizer steps with a non-finite loss or grad norm are skipped; this many in a row stop the run."""
    sequence_parallel_size: int = Field(default=1, gt=0)
    """Learners that share each micro-batch (Ulysses sequence parallelism, `distrl.workers.training.ulysses`): the
    packed row's tokens are split into this many slices, one per learner, and each layer's attention exchanges heads
    for tokens (an all-to-all) so that every learner attends over the whole sequences for 1/k of the heads. The
    learners form a data-parallel x sequence-parallel grid: the batch is split over `num_actors / k` data-parallel
    groups, and the k learners of a group see the same micro-batches. Activations per learner fall about k-fold; the
    model's attention and key/value head counts and the learner count (`cluster.learner.num_actors`; the critic's:
    `cluster.critic.num_actors`) must be multiples of it."""
    lora: LoraConfig | None = None
    """Train low-rank adapters instead of the whole model (`LoraConfig`); null: full fine-tuning."""
    router_aux_loss_coef: float = Field(default=0.0, ge=0.0)
    """A mixture-of-experts policy: the coefficient of its routers' load-balancing loss (Switch Transformer's, as
    transformers computes it for the model: E * sum_e f_e P_e over every layer's tokens, `moe/aux_loss`) added to
    the policy loss; 0 adds none (the router is trained by the policy loss alone). Default 0, as slime: the router
    comes balanced from pre-training, RL's batches are few and narrow, and a term that pushes the routes toward
    balance rather than reward moves them away from what the engine routed (the largest rollout/trainer mismatch of
    a MoE); TRL's GRPO adds 1e-3. The load it would correct is logged either way (`moe/max_vio`, `moe/router_entropy`):
    set it (1e-3 is the models' own pre-training value) when `moe/max_vio` grows. No effect on a dense model."""

    @model_validator(mode="before")
    @classmethod
    def _moved(cls, data: Any) -> Any:
        section = cls.SECTION
        return refuse_moved(data, section, {
            "min_lr_ratio": f"{section}.lr_schedule.min_lr_ratio, a field of the cosine schedule only: write "
                            f"`{section}.lr_schedule: {{{{type: cosine, min_lr_ratio: {{value}}}}}}`"})


class CriticConfig(LearnerConfig):
    """The value model of `algorithm.advantage: gae`, trained on the same batches as the policy with the clipped
    value loss. Its optimisation settings are the learner's (same fields, same meaning, its own values)."""

    SECTION: ClassVar[str] = "critic"

    path: str | None = None
    """Value model: null = the policy's model (`model.path`) with a fresh scalar value head, initialised from
    `run.seed`; a path loads that HF directory as a token-classification model with one label (e.g. a trained
    reward or value model; its tokenizer must be the policy's)."""
    value_clip: float | None = Field(default=0.2, gt=0.0)
    """Clip range of the value loss: the new value may move at most this far from the value computed before the
    update (torchtune PPOLoss value_clip_range, verl cliprange_value); null: the plain squared error."""

    @model_validator(mode="after")
    def _no_lora(self) -> CriticConfig:
        if self.lora is not None:
            raise ValueError("critic.lora: the value model trains in full (adapters are the policy's: learner.lora)")
        if self.router_aux_loss_coef:
            raise ValueError("critic.router_aux_loss_coef: the value model's loss is the value loss alone (a "
                             "load-balancing loss is the policy's: learner.router_aux_loss_coef)")
        return self


class ReferenceConfig(Section):
    path: str | None = None
    """Reference model; null means the initial policy (`model.path`). Created only when a KL term needs it."""
    dtype: Dtype = "float32"
    """Dtype the reference model runs in. Left out, it is bfloat16 when the reference has GPUs
    (`cluster.reference.num_gpus` > 0, given or defaulted to the learners'), else float32."""
    micro_batch_size: int = Field(default=8, gt=0)
    """Sequences per reference forward pass (when `max_tokens_per_micro_batch` is null)."""
    max_tokens_per_micro_batch: TokenBudget = None
    """Token budget of one reference forward pass: sequences (prompt + response tokens, no padding) go into as few
    balanced micro-batches of at most this many tokens as first-fit decreasing finds; a longer sequence goes alone.
    `auto`: from the GPU's free memory and the model's shape (no gradients: far more than a learner's). Null: fixed
    micro-batches of `micro_batch_size` sequences. Left out with `micro_batch_size` left out too, it is `auto` when
    the reference has GPUs."""
    kernels: Kernels = "plain"
    """Kernels of the reference's forward pass: `plain`, `liger` or `compile`, as `learner.kernels`. Left out, it is
    `liger` when the reference has GPUs."""
    sequence_parallel_size: int = Field(default=1, gt=0)
    """Reference actors that share each micro-batch, as `learner.sequence_parallel_size` (Ulysses: each holds 1/k of
    the packed row's tokens and attends with 1/k of the heads), for contexts whose forward pass one device cannot
    hold. The reference actors form groups of k (`cluster.reference.num_actors` must be a multiple of it) joined in
    a process group (`cluster.backend: ray`); the batch is split over `num_actors / k` groups. The reference model's
    attention and key/value head counts must be multiples of it. With `learner.lora` the learners answer for the
    reference (their base model, split by their own `sequence_parallel_size`), and hybrid actors host one reference
    each beside their learner: both leave this at 1."""
