"""The config's defaults that depend on where a role runs (`apply_gpu_defaults`, applied when a `Config` is
validated), and the check that fused kernels run on GPUs (`kernel_problems`).

A default chosen here is not marked as set by the config (a section's `model_fields_set` keeps what the config
wrote), so that later checks can tell the two apart: the preflight falls back from a defaulted `kernels: liger` to
`plain` where liger-kernel cannot run, and refuses a `liger` the config asked for
(`distrl.workers.training.kernel_support`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from distrl.config.cluster import ClusterConfig
from distrl.config.learner import CriticConfig, LearnerConfig, ReferenceConfig
from distrl.config.rollout import RolloutConfig


def apply_gpu_defaults(cluster: ClusterConfig, rollout: RolloutConfig, learner: LearnerConfig,
                       critic: CriticConfig | None, reference: ReferenceConfig, needs_reference: bool) -> None:
    """The defaults that depend on where a role runs, for the fields the config leaves out (a field it sets, even to
    the plain default, is kept; the run's saved config.yaml holds the values chosen here):

    - `cluster.reference.num_gpus`: the learners' `num_gpus` when a KL term needs a reference and the learners have
      GPUs. Placed, not only warned about: a reference left on the CPU beside GPU learners scores every batch in
      float32 on half a core (`cluster.reference.num_cpus`), the slowest role of every step, and a warning in a long
      log is easy to miss; a cluster without a spare GPU then fails at placement (preflight names the GPUs it lacks)
      and `cluster.reference.num_gpus: 0` keeps it on the CPU.
    - `learner.dtype`, `critic.dtype`, `reference.dtype`: bfloat16 for a role with GPUs (weights and AdamW state stay
      float32; on a GPU float32 matmuls run many times slower). On the CPU float32, the exact reference.
    - `rollout.enforce_eager`: false for engines with GPUs (CUDA graphs and torch.compile: slower start-up, much
      faster decoding); true on the CPU, whose vLLM build runs eagerly.
    - `learner.max_tokens_per_micro_batch`, `critic...`, `reference...`: `auto` for a role with GPUs whose config
      sets neither it nor `micro_batch_size` (micro-batches by a token budget that follows the model's size and the
      GPU's memory, resolved on the role's GPU: docs/learner-performance.md); fixed counts on the CPU.
    - `learner.kernels`, `critic.kernels`, `reference.kernels`: `liger` for a role with GPUs (fused RMSNorm, rotary
      embedding and SwiGLU; `plain` on the CPU, where the Triton kernels do not run).

    In hybrid mode the engine and the reference run on the learners' devices (`cluster.learner`).
    """
    hybrid = cluster.hybrid_mode  # the engine and the reference run on the learners' devices
    if (needs_reference and cluster.learner.num_gpus > 0 and not hybrid
            and "num_gpus" not in cluster.reference.model_fields_set):
        _default(cluster.reference, "num_gpus", cluster.learner.num_gpus)
    for section, role in ((learner, cluster.learner), (critic, cluster.critic),
                          (reference, cluster.learner if hybrid else cluster.reference)):
        if section is None or role.num_gpus <= 0:
            continue
        if "dtype" not in section.model_fields_set:
            _default(section, "dtype", "bfloat16")
        if "kernels" not in section.model_fields_set:
            _default(section, "kernels", "liger")
        if not {"max_tokens_per_micro_batch", "micro_batch_size"} & section.model_fields_set:
            _default(section, "max_tokens_per_micro_batch", "auto")
    engines = cluster.learner if hybrid else cluster.rollout
    if engines.num_gpus > 0 and "enforce_eager" not in rollout.model_fields_set:
        _default(rollout, "enforce_eager", False)


def _default(section: BaseModel, field: str, value: Any) -> None:
    """Set `field` of `section` to the default `value`, left unmarked as set by the config."""
    setattr(section, field, value)
    section.__pydantic_fields_set__.discard(field)


def kernel_problems(cluster: ClusterConfig, learner: LearnerConfig, critic: CriticConfig | None,
                    reference: ReferenceConfig | None) -> list[str]:
    """Fused kernels asked for a role that runs on the CPU (they are CUDA's); `reference` None when no reference
    runs."""
    hybrid = cluster.hybrid_mode
    roles = (("learner", learner, cluster.learner), ("critic", critic, cluster.critic),
             ("reference", reference, cluster.learner if hybrid else cluster.reference))
    return [f"{name}.kernels '{section.kernels}' needs a GPU, and the {name} runs on the CPU "
            f"(cluster.{'learner' if hybrid and name == 'reference' else name}.num_gpus is 0): set "
            f"{name}.kernels: plain" for name, section, role in roles
            if section is not None and section.kernels != "plain" and role.num_gpus <= 0]
