"""`Config`, the root of the tree: its sections, sizes derived from them, and the checks that span sections (each
message names every field it involves; the critic's, hybrid mode's and LoRA's in `checks`), with the defaults that
depend on where a role runs applied first (`gpu_defaults`)."""

from __future__ import annotations

import warnings
from typing import Any

from pydantic import Field, model_validator

from distrl.config.algorithm import GROUP_ESTIMATORS, AlgorithmConfig
from distrl.config.base import Section
from distrl.config.checks import (
    critic_problems,
    hybrid_problems,
    learner_batch_problems,
    lora_problems,
    partial_rollout_problems,
    routing_replay_problems,
    sequence_parallel_problems,
    tensor_parallel_problems,
)
from distrl.config.cluster import ClusterConfig
from distrl.config.env import EnvConfig
from distrl.config.eval import EvalConfig
from distrl.config.gpu_defaults import apply_gpu_defaults, kernel_problems
from distrl.config.gpus import gpu_sharing_problems, idle_gpu_warnings
from distrl.config.learner import CriticConfig, LearnerConfig, LoraConfig, ReferenceConfig
from distrl.config.loop import AsyncLoop, Loop, SyncLoop
from distrl.config.loss import LossConfig
from distrl.config.model import DataConfig, ModelConfig
from distrl.config.nodes import elastic_problems, unused_placement_problems
from distrl.config.policy import COVARIANCE_TYPES
from distrl.config.reward import RewardConfig
from distrl.config.rollout import RolloutConfig
from distrl.config.run import RunConfig


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
    critic: CriticConfig | None = None
    """Value model for `algorithm.advantage: gae` (needed by it, and only by it)."""
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    """Advantage estimation and the source of old log-probs."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Policy loss."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward function (of one-turn episodes; with an `env` section the environment rewards)."""
    env: EnvConfig | None = None
    """Environment of multi-turn, tool-using episodes; null: one turn per episode, scored by `reward`."""
    eval: EvalConfig | None = None
    """Held-out sets evaluated on the rollout engines during training; null: none."""
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    """Actor counts, resources and placement."""
    loop: Loop = Field(default_factory=SyncLoop)
    """Synchronous (`mode: sync`) or asynchronous (`mode: async`, `max_staleness: k`) training loop."""
    run: RunConfig = Field(default_factory=RunConfig)
    """Steps, seed, outputs."""

    @property
    def longest_prompt_tokens(self) -> int:
        """The longest prompt an engine is given: `data.max_prompt_tokens`, or an eval set's if longer."""
        sets = self.eval.sets if self.eval is not None else []
        return max([self.data.max_prompt_tokens, *(s.max_prompt_tokens for s in sets)])

    @property
    def longest_turn_tokens(self) -> int:
        """The longest turn an engine samples: `rollout.sampling.max_new_tokens`, or the evaluation's if longer."""
        evaluation = self.eval.sampling.max_new_tokens if self.eval is not None else None
        return max(self.rollout.sampling.max_new_tokens, evaluation or 0)

    @property
    def global_batch_size(self) -> int:
        """Sequences per step: prompts_per_step x n_samples_per_prompt."""
        return self.rollout.prompts_per_step * self.rollout.n_samples_per_prompt

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimizer step (the whole batch when `learner.mini_batch_size` is null)."""
        return self.learner.mini_batch_size or self.global_batch_size

    @property
    def mini_batches(self) -> int:
        """Policy optimizer steps per pass over a step's batch: global_batch_size / mini_batch_size, however many
        rows the batch has (episodes of several sequences make more than global_batch_size)."""
        return self.global_batch_size // self.mini_batch_size

    @property
    def old_logprobs_in_update(self) -> bool:
        """Whether the learners take the old log-probs from the update's own forward pass (see
        `algorithm.old_logprobs`): the update is a single optimizer step from the proximal policy, and nothing needs
        the old log-probs before it (KL in the reward does, and so does a loss that selects tokens by covariance over
        the whole batch, `COVARIANCE_TYPES`)."""
        return (self.algorithm.old_logprobs == "recompute" and self.learner.ppo_epochs == 1
                and self.mini_batch_size == self.global_batch_size
                and not (self.loss.kl.target == "reward" and self.loss.kl.coef > 0)
                and self.loss.policy.type not in COVARIANCE_TYPES)

    @property
    def needs_ref_logprobs(self) -> bool:
        """Whether the step needs reference log-probs (a KL term with a non-zero coefficient)."""
        return self.loss.kl.coef > 0.0

    @property
    def engines(self) -> int:
        """Rollout engines of the job: one per rollout actor, or one per hybrid actor (`cluster.colocate: hybrid`)."""
        c = self.cluster
        return c.learner.num_actors if c.hybrid_mode else c.rollout.num_actors

    @property
    def needs_reference(self) -> bool:
        """Whether a reference actor must exist: reference log-probs are needed and the learners cannot give them
        (with `learner.lora` the reference is the learners' own base model, the adapters disabled)."""
        return self.needs_ref_logprobs and self.learner.lora is None

    @property
    def served_adapters(self) -> LoraConfig | None:
        """The adapters the engines serve through vLLM's LoRA support: `learner.lora` served as adapters; None when
        the engines serve plain weights (full fine-tuning, or adapters pushed merged: `learner.lora.serve`)."""
        lora = self.learner.lora
        return lora if lora is not None and lora.serve == "adapters" else None

    @property
    def norm_len(self) -> int:
        """Dr. GRPO's constant divisor (`loss.policy.norm_len`): by default the most tokens a sample can train on,
        `rollout.sampling.max_new_tokens` for one turn, and with an `env` section `env.max_turns` such turns (at
        most `env.max_tokens`)."""
        if self.loss.policy.norm_len is not None:
            return self.loss.policy.norm_len
        turn = self.rollout.sampling.max_new_tokens
        if self.env is None:
            return turn
        trained = self.env.max_turns * turn
        return min(trained, self.env.max_tokens) if self.env.max_tokens is not None else trained

    @property
    def chunks_per_engine(self) -> int:
        """Chunks one engine serves at once (`rollout.chunks_per_engine`, or its default for the job: a hybrid
        actor runs one call at a time, so its engine serves one chunk, all of whose episodes share it at once)."""
        return self.rollout.chunks_per_engine or (1 if self.env is None or self.cluster.hybrid_mode else 4)

    @property
    def slice_tokens(self) -> int | None:
        """Tokens of a sample per generation call with `loop.partial_rollouts` (None: samples end in one call)."""
        return self.loop.slice_tokens if isinstance(self.loop, AsyncLoop) and self.loop.partial_rollouts else None

    @property
    def max_staleness(self) -> int:
        """k of the loop: 0 for the synchronous loop."""
        return self.loop.max_staleness if isinstance(self.loop, AsyncLoop) else 0

    @model_validator(mode="before")
    @classmethod
    def _eval_sets_take_the_data_spec(cls, tree: Any) -> Any:
        """An eval set's dataset fields that it does not give itself are `data`'s: all of them when it reads the
        same source (a held-out split needs only its name, path and split), and how prompts are rendered
        (`chat_template`, `system_prompt`, `max_prompt_tokens`) when it reads another, whose columns are its own."""
        if not (isinstance(tree, dict) and isinstance(tree.get("data"), dict) and isinstance(tree.get("eval"), dict)
                and isinstance(tree["eval"].get("sets"), list)):
            return tree
        def inherited(own: dict) -> dict:
            data = {k: v for k, v in tree["data"].items() if k not in ("path", "shuffle")}
            if own.get("path") != tree["data"].get("path"):  # another source: only how prompts are rendered
                data = {k: v for k, v in data.items() if k in ("chat_template", "system_prompt", "max_prompt_tokens")}
            if {"prompt", "prompt_key"} & own.keys():  # one field, two spellings
                data = {k: v for k, v in data.items() if k not in ("prompt", "prompt_key")}
            return {**data, **own}

        sets = [inherited(s) if isinstance(s, dict) else s for s in tree["eval"]["sets"]]
        return {**tree, "eval": {**tree["eval"], "sets": sets}}

    @model_validator(mode="after")
    def _gpu_defaults(self) -> Config:
        """The defaults that depend on where a role runs (`gpu_defaults.apply_gpu_defaults`)."""
        apply_gpu_defaults(self.cluster, self.rollout, self.learner, self.critic, self.reference,
                           self.needs_reference)
        return self

    @model_validator(mode="after")
    def _held_out_is_held_out(self) -> Config:
        source = ("path", "function", "kwargs", "subset", "split", "revision")
        for i, s in enumerate(self.eval.sets if self.eval is not None else []):
            if all(getattr(s, k) == getattr(self.data, k) for k in source):
                if s.function is not None:
                    raise ValueError(f"eval.sets[{i}] ({s.name}) makes the training data ({s.function} with the "
                                     f"same kwargs): give it its own kwargs (another seed)")
                raise ValueError(f"eval.sets[{i}] ({s.name}) reads the training data ({s.path}, split "
                                 f"{s.split or 'train'}): give it its own split or path")
        return self

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
        if self.cluster.backend == "local" and self.learner.strategy.type == "fsdp":
            errors.append("learner.strategy 'fsdp' shards the model over the learners' process group, which "
                          "cluster.backend 'local' does not have; use cluster.backend 'ray' (one learner is fine)")
        if self.cluster.backend == "local" and self.cluster.weight_sync == "nccl":
            errors.append("cluster.weight_sync 'nccl' needs Ray actors on GPUs; cluster.backend is 'local'")
        adv = self.algorithm.advantage
        g = self.rollout.n_samples_per_prompt
        if adv in GROUP_ESTIMATORS and g < 2:
            errors.append(f"algorithm.advantage '{adv}' compares samples within a group and needs "
                          f"rollout.n_samples_per_prompt >= 2 (got {g})")
        errors += critic_problems(self.critic, self.cluster, self.algorithm.advantage, self.global_batch_size,
                                  self.critic_mini_batch_size)
        errors += hybrid_problems(self.cluster, self.rollout, self.max_staleness)
        errors += lora_problems(self.learner, self.reference, self.cluster, self.needs_ref_logprobs)
        errors += kernel_problems(self.cluster, self.learner, self.critic,
                                  self.reference if self.needs_reference else None)
        errors += sequence_parallel_problems(self.learner, self.critic, self.cluster,
                                             self.reference if self.needs_ref_logprobs else None)
        errors += learner_batch_problems(self.learner, self.cluster, self.global_batch_size, self.mini_batch_size)
        if self.algorithm.old_logprobs == "rollout" and self.loss.correction is not None:
            errors.append("loss.correction needs algorithm.old_logprobs 'recompute': with 'rollout' the old and "
                          "rollout log-probs are the same and every weight would be 1")
        if self.rollout.max_model_len is not None and (
            self.rollout.max_model_len < self.data.max_prompt_tokens + self.rollout.sampling.max_new_tokens
        ):
            errors.append(f"rollout.max_model_len ({self.rollout.max_model_len}) must be >= data.max_prompt_tokens "
                          f"+ rollout.sampling.max_new_tokens "
                          f"({self.data.max_prompt_tokens + self.rollout.sampling.max_new_tokens})")
        errors += tensor_parallel_problems(self.rollout, self.cluster)
        errors += routing_replay_problems(self.rollout, self.learner, self.cluster,
                                          self.reference if self.needs_reference else None)
        if self.slice_tokens is not None:
            errors += partial_rollout_problems(self.rollout, self.env is not None)
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
        errors += gpu_sharing_problems(self.cluster, critics=self.critic is not None,
                                       lora=self.learner.lora is not None)
        errors += elastic_problems(self.cluster, self.max_staleness)
        errors += unused_placement_problems(self.cluster)
        if self.cluster.num_cpus is not None and self.cluster.address is None:
            problem = self.unplaceable(self.cluster.num_cpus, "cluster.num_cpus", "num_cpus")
            if problem:
                errors.append(problem)
        if errors:
            raise ValueError("\n".join(errors))
        apart = not self.cluster.hybrid_mode  # hybrid actors host the engine and the reference on the learners' GPUs
        one_gpu_engines = apart and self.rollout.tensor_parallel_size == 1  # a TP engine's workers use all its GPUs
        used = ("learner", *(["rollout"] if one_gpu_engines else []),
                *(["reference"] if self.needs_reference and apart else []),
                *(["critic"] if self.critic is not None else []))
        for line in idle_gpu_warnings(self.cluster, used):
            warnings.warn(line, UserWarning, stacklevel=2)
        return self

    @property
    def critic_mini_batch_size(self) -> int:
        """Sequences per critic optimizer step (the whole batch when `critic.mini_batch_size` is null)."""
        return (self.critic.mini_batch_size if self.critic else None) or self.global_batch_size

    @property
    def critic_mini_batches(self) -> int:
        """Critic optimizer steps per pass over a step's batch: global_batch_size / critic_mini_batch_size."""
        return self.global_batch_size // self.critic_mini_batch_size

    def unplaceable(self, have: float, what: str, resource: str) -> str | None:
        """Why the roles' `resource` (num_cpus or num_gpus) cannot fit in the `have` of one node (`what` names
        where that figure comes from), or None. A reward task needs reward.num_cpus besides the actors."""
        hybrid = self.cluster.hybrid_mode  # the learners host the engines and the reference
        roles = [("learner", self.cluster.learner)] if hybrid else [("rollout", self.cluster.rollout),
                                                                      ("learner", self.cluster.learner)]
        if self.needs_reference and not hybrid:
            roles.append(("reference", self.cluster.reference))
        if self.critic is not None:
            roles.append(("critic", self.cluster.critic))
        reward = self.reward.num_cpus if resource == "num_cpus" else 0.0
        demand = sum(r.num_actors * getattr(r, resource) for _, r in roles) + reward
        if demand <= have + 1e-9:
            return None
        parts = " + ".join(f"cluster.{n}.num_actors x {resource} ({r.num_actors} x {getattr(r, resource)})"
                           for n, r in roles if getattr(r, resource))
        tail = f" and a reward task needs reward.num_cpus ({reward})" if reward else ""
        return f"the embedded cluster has {what} = {have:g} but the actors reserve {parts}{tail}: {demand:g} in all"
