"""Checks of the roles' GPU shares against what NCCL allows (review B3), on the `cluster` section.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"). A Ray actor given a fractional
GPU (`num_gpus: 0.5`) may share its GPU with another actor, of its role or another, whatever the placement: a
bundle of a whole number of GPUs is never shared, `cluster.colocate: true` (one PACK placement group) included, so
only fractional shares are refused, and only where an NCCL group spans the actors that have them:

- the weight-sync world (learner 0 and every engine), when `cluster.weight_sync` is `nccl`, or `auto` with GPUs
  on both roles on Ray and full weights to push (which then picks NCCL: `distrl.cluster.roles`; `learner.lora`'s
  adapters go through the object store);
- the learners' (and critics') own process group, NCCL on the GPU, when there are two of them or more.

The weight-sync check applies to every `cluster.colocate` mode but `hybrid`, whose actors host the engine inside
the learner's process and pass weights in memory, with no NCCL world.

Also a warning for a role given more than one GPU per actor: each of its actors computes on `cuda:0` only (vLLM with
`rollout.tensor_parallel_size` 1; one learner, reference or critic per GPU), and the others stay idle.
"""

from __future__ import annotations

from distrl.config.cluster import ClusterConfig

ROLES = ("rollout", "learner", "reference", "critic")
HYBRID = "hybrid"
"""The `cluster.colocate` mode with the engine in the learner's actor (no NCCL weight-sync world)."""


def nccl_weight_sync(c: ClusterConfig, lora: bool) -> bool:
    """Whether weights go from learner 0 to the engines over NCCL (`cluster.weight_sync`, resolved; `lora`: the
    pushes carry `learner.lora`'s adapters, which `auto` sends through the object store)."""
    gpus = c.learner.num_gpus > 0 and c.rollout.num_gpus > 0
    return c.weight_sync == "nccl" or (c.weight_sync == "auto" and gpus and c.backend == "ray" and not lora)


def _fractional(num_gpus: float) -> bool:
    return num_gpus > 0 and num_gpus != int(num_gpus)


def gpu_sharing_problems(c: ClusterConfig, critics: bool, lora: bool) -> list[str]:
    """Fractional GPU shares in an NCCL group, one message per field (`critics`: the job has a critic role;
    `lora`: the learners train `learner.lora` adapters)."""
    problems = []
    if c.colocate != HYBRID and nccl_weight_sync(c, lora):
        how = "nccl" if c.weight_sync == "nccl" else "auto, which picks nccl when both roles have GPUs"
        for role in ("learner", "rollout"):
            share = getattr(c, role).num_gpus
            if _fractional(share):
                problems.append(
                    f"cluster.{role}.num_gpus ({share:g}) is a fraction of a GPU, and cluster.weight_sync is {how}: "
                    f"an actor may then share its GPU with another rank of the NCCL weight-sync world, which NCCL "
                    f"refuses ('Duplicate GPU detected'). Give each {role} actor whole GPUs, or set "
                    f"cluster.weight_sync: object_store")
    for role, present in (("learner", True), ("critic", critics)):
        r = getattr(c, role)
        if present and r.num_actors > 1 and _fractional(r.num_gpus):
            problems.append(
                f"cluster.{role}.num_gpus ({r.num_gpus:g}) is a fraction of a GPU with cluster.{role}.num_actors = "
                f"{r.num_actors}: the {role}s' process group is NCCL on the GPU, and two {role}s on one GPU make NCCL "
                f"fail ('Duplicate GPU detected'). Give each {role} actor whole GPUs")
    return problems


def idle_gpu_warnings(c: ClusterConfig, roles: tuple[str, ...] = ROLES) -> list[str]:
    """A line for each of `roles` given more than one GPU per actor, of which it uses one."""
    return [f"cluster.{role}.num_gpus is {getattr(c, role).num_gpus:g}, but each {role} actor computes on one GPU "
            f"(cuda:0): the other {getattr(c, role).num_gpus - 1:g} per actor stay idle; give it 1 and scale with "
            f"cluster.{role}.num_actors"
            for role in roles if getattr(c, role).num_gpus > 1]
