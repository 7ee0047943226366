"""Starting the job's actor groups from the config: rollout (vLLM), reference (only when a KL term needs it and the
learners cannot answer for it: with `learner.lora` the reference is their base model, the adapters disabled),
learners (data-parallel, joined in one torch.distributed group) and critics (only for GAE; data-parallel in their
own group), plus the weight sync between the learners and the engines.

Resource arithmetic lives here so the driver reads like the algorithm.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from distrl.agents.agent import host_of
from distrl.cluster import capacity
from distrl.cluster.backend import Backend, RayBackend
from distrl.cluster.envs import EPISODES_PER_ACTOR, env_client, node_address
from distrl.cluster.group import ActorGroup, start_group
from distrl.cluster.hybrid import HybridSync, RoleView
from distrl.cluster.placement import place, release
from distrl.cluster.weight_sync import WeightSync, make_weight_sync
from distrl.config import Config, RoleResources
from distrl.workers.hybrid import HybridWorker
from distrl.workers.rollout.vllm_engine import ENGINE_ENV
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training.critic import Critic
from distrl.workers.training.learner import Learner
from distrl.workers.training.reference import ReferenceWorker


@dataclass
class Roles:
    backend: Backend
    rollout: ActorGroup[RolloutWorker]
    learner: ActorGroup[Learner]
    reference: ActorGroup[ReferenceWorker] | None
    sync: WeightSync
    critic: ActorGroup[Critic] | None = None


def actor_env(role: str, cfg: Config, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the actors of `role` (rollout, learner, reference, critic): its thread count, no visible GPU
    when it was granted none (else a GPU build of vLLM or torch would take GPU 0 of a GPU node; and for sharded
    learners on the CPU, freed large blocks returned to the system), then `extra` (the role's own), then
    `cluster.actor_env`."""
    env = {"OMP_NUM_THREADS": str(role_threads(role, cfg)), "TOKENIZERS_PARALLELISM": "false"}
    if getattr(cfg.cluster, role).num_gpus == 0:
        env["CUDA_VISIBLE_DEVICES"] = ""
        trained = {"learner": cfg.learner, "critic": cfg.critic}.get(role)
        if trained is not None and trained.strategy.type == "fsdp":
            # FSDP's all-gather and reduce-scatter buffers are freed and made again every layer; glibc keeps such
            # blocks in the heap, so a CPU learner's peak stayed at a replica's. Blocks of 1 MB and more mapped
            # apart go back to the system: 1015 MB against 2590 MB on 2 learners (bench_learner_memory.py).
            env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
    return {**env, **(extra or {}), **cfg.cluster.actor_env}


def role_threads(role: str, cfg: Config) -> int:
    """Compute threads of each actor of `role` (OMP_NUM_THREADS, which torch and vLLM's CPU kernels follow).

    `num_threads` when set. Otherwise the reserved CPUs rounded up (Ray would give a fractional-CPU actor one
    thread; naming it keeps torch and vLLM in agreement), except in the synchronous loop on the embedded cluster,
    where the roles take turns: the engines generate while the reference and learners wait, then those score and
    train while the engines wait. A role may then use every core of the machine, shared among its own actors and,
    when the learners compute old log-probs while the reference scores, among those two roles' actors (measured on
    2 cores: the quickstart's step 0.66 s with one thread each, 0.53 s with the learner and reference on two).
    On a joined cluster the node sizes are not known before placement, so the reservation decides."""
    c = cfg.cluster
    r: RoleResources = getattr(c, role)
    if r.num_threads:
        return r.num_threads
    reserved = max(1, math.ceil(r.num_cpus))
    embedded = c.address is None and not os.environ.get("RAY_ADDRESS")
    # Hybrid actors run their phases one after the other in either loop: they take turns with nothing but critics.
    if (cfg.max_staleness > 0 and not c.hybrid_mode) or not embedded or c.backend == "local":
        return reserved
    cores = c.num_cpus or os.cpu_count() or 1
    # Roles that score or train at the same time: the learners with the critics (values beside the old log-probs,
    # updates side by side), and the reference with whichever of them score before the update.
    together = ["learner", *(["critic"] if cfg.critic is not None else [])]
    if cfg.needs_reference and not c.hybrid_mode and (cfg.critic is not None or not cfg.old_logprobs_in_update):
        together.append("reference")
    sharing = r.num_actors
    if role in together and len(together) > 1:
        sharing = sum(getattr(c, name).num_actors for name in together)
    return max(reserved, cores // sharing)


def total_optimizer_steps(cfg: Config) -> int:
    return cfg.run.steps * cfg.learner.ppo_epochs * cfg.mini_batches


def critic_optimizer_steps(cfg: Config) -> int:
    epochs = cfg.critic.ppo_epochs if cfg.critic is not None else 1
    return cfg.run.steps * epochs * cfg.critic_mini_batches


def demands(cfg: Config) -> dict[str, RoleResources]:
    """The resources of each role this job starts actors for."""
    c = cfg.cluster
    # Hybrid actors are learners that host the engine and the reference: they take the learners' resources.
    roles: dict[str, RoleResources] = ({"learner": c.learner} if c.hybrid_mode
                                       else {"rollout": c.rollout, "learner": c.learner})
    if cfg.needs_reference and not c.hybrid_mode:
        roles["reference"] = c.reference
    if cfg.critic is not None:
        roles["critic"] = c.critic
    if cfg.env is not None:
        roles["env"] = c.env
    return roles


def check_capacity(cfg: Config, backend: Backend) -> None:
    """Before any actor starts: on Ray, whether the cluster's alive nodes can hold every role (its labels,
    resources, CPUs and GPUs: `distrl.cluster.capacity`); raises PreflightError naming each role and what is
    missing."""
    if not isinstance(backend, RayBackend):
        return
    from distrl.preflight import PreflightError

    problems = capacity.problems(capacity.alive_nodes(), demands(cfg), reward_cpus=cfg.reward.num_cpus)
    if problems and backend.embedded:
        problems.append("cluster.address: the embedded cluster is this machine alone, without node labels or "
                        "custom resources: join a cluster whose nodes have them (cluster.address, or a Ray job)")
    if problems:
        raise PreflightError(problems)


@contextmanager
def started_roles(cfg: Config, backend: Backend, rollout_worker: type = RolloutWorker,
                  restart: bool = False) -> Iterator[Roles]:
    """Place and start every role on `backend`, connect the learners' process group, set up the weight sync; on
    exit (or if any of that fails halfway) kill every actor started and release the placement groups.
    `rollout_worker` is the engine class (tests of the loop pass one that samples with HF). `restart`: the roles
    start again after a death, and their placement may wait `cluster.recovery.start_timeout_s` for nodes (a lost
    node's replacement, or room an autoscaler adds) rather than `cluster.placement_timeout_s`."""
    c = cfg.cluster
    timeout_s, setting = ((c.recovery.start_timeout_s, "cluster.recovery.start_timeout_s") if restart
                          else (c.placement_timeout_s, "cluster.placement_timeout_s"))
    placements = place(backend, demands(cfg), colocate=c.colocate == "pack", run_name=cfg.run.name,
                       timeout_s=timeout_s, setting=setting)
    groups: list[ActorGroup] = []
    try:
        yield _start(cfg, backend, placements, groups, rollout_worker)
    finally:
        for group in groups:
            group.kill()
        release(placements)


def sampling_seed(cfg: Config) -> int:
    """The run's sampling seed: `rollout.seed`, or 1000 x `run.seed`. Every engine gets it; each sample's own seed
    is derived from it and the sample's prompt ticket (`distrl.workers.rollout.sampling.request_seed`)."""
    return cfg.rollout.seed if cfg.rollout.seed is not None else cfg.run.seed * 1000


def _start(cfg: Config, backend: Backend, placements: dict, groups: list[ActorGroup], rollout_worker: type) -> Roles:
    c, name = cfg.cluster, cfg.run.name
    envs = None
    if cfg.env is not None:
        host, args = host_of(cfg.env)
        env_group = start_group(backend, host, "env", c.env, placements["env"], run_name=name,
                                env=actor_env("env", cfg), init=lambda i: (args, {}),
                                concurrency=EPISODES_PER_ACTOR, self_restarts=c.recovery.max_restarts)
        groups.append(env_group)
        envs = env_client(env_group)
    inits = RoleInits(cfg, envs, own_processes=isinstance(backend, RayBackend))
    reference: ActorGroup[ReferenceWorker] | None = None
    if c.hybrid_mode:
        hybrids = start_group(
            backend, HybridWorker, "hybrid", c.learner, placements["learner"], run_name=name,
            env=actor_env("learner", cfg, ENGINE_ENV),
            init=lambda i: ((inits.learner(i), inits.rollout(i, c.learner.num_gpus, sleep_mode=True),
                             inits.reference(i, c.learner.num_gpus) if cfg.needs_reference else None, c.hybrid),
                            dict(dtype=cfg.rollout.dtype, bucket_bytes=c.sync_bucket_bytes,
                                 full_pushes=cfg.learner.lora is None,
                                 sync_loop=cfg.max_staleness == 0, grouped=isinstance(backend, RayBackend))))
        groups.append(hybrids)
        rollout: ActorGroup[RolloutWorker] = RoleView(hybrids, "rollout")
        learner: ActorGroup[Learner] = RoleView(hybrids, "learner")
        if cfg.needs_reference:
            reference = RoleView(hybrids, "reference")
    else:
        rollout = start_group(
            backend, rollout_worker, "rollout", c.rollout, placements["rollout"], run_name=name,
            env=actor_env("rollout", cfg, ENGINE_ENV), init=lambda i: inits.rollout(i, c.rollout.num_gpus),
            # Serving several chunks, an engine also takes weight pushes and checks while they run (between steps).
            concurrency=1 if cfg.chunks_per_engine == 1 else cfg.chunks_per_engine + 2)
        groups.append(rollout)
        learner = start_group(backend, Learner, "learner", c.learner, placements["learner"], run_name=name,
                              env=actor_env("learner", cfg), init=inits.learner)
        groups.append(learner)
        if cfg.needs_reference:
            reference = start_group(backend, ReferenceWorker, "reference", c.reference, placements["reference"],
                                    run_name=name, env=actor_env("reference", cfg),
                                    init=lambda i: inits.reference(i, c.reference.num_gpus))
            groups.append(reference)
    critic = None
    if cfg.critic is not None:
        critic_cfg = cfg.critic
        critic = start_group(
            backend, Critic, "critic", c.critic, placements["critic"], run_name=name, env=actor_env("critic", cfg),
            init=lambda i: ((cfg.model, critic_cfg), dict(
                mini_batch_size=cfg.critic_mini_batch_size, total_optimizer_steps=critic_optimizer_steps(cfg),
                seed=cfg.run.seed, num_gpus=c.critic.num_gpus)))
        groups.append(critic)
    if isinstance(backend, RayBackend):  # the local backend holds one learner, which needs no process group
        _connect(backend, learner, "learner", Learner.free_port, Learner.connect, c.call_timeout_s,
                 group_timeout_s(cfg))
        if critic is not None:  # the critics' own group: their gradients are summed apart from the policy's
            _connect(backend, critic, "critic", Critic.free_port, Critic.connect, c.call_timeout_s,
                     group_timeout_s(cfg))
        if reference is not None and cfg.reference.sequence_parallel_size > 1:  # groups that split micro-batches
            _connect(backend, reference, "reference", ReferenceWorker.free_port, ReferenceWorker.connect,
                     c.call_timeout_s, group_timeout_s(cfg))
    if c.hybrid_mode:
        sync: WeightSync = HybridSync(hybrids, learner, rollout, cfg.rollout.dtype, c.sync_bucket_bytes,
                                      c.sync_timeout_s, c.verify_weights)
    else:
        gpus = c.learner.num_gpus > 0 and c.rollout.num_gpus > 0
        # Adapters (learner.lora) are megabytes: the object store carries them on GPUs too.
        sync = make_weight_sync(c.weight_sync, learner, rollout, cfg.rollout.dtype, c.sync_bucket_bytes,
                                gpus and cfg.learner.lora is None, c.sync_timeout_s, c.verify_weights,
                                cfg.rollout.tensor_parallel_size)
    return Roles(backend, rollout, learner, reference, sync, critic)


@dataclass
class RoleInits:
    """The constructor arguments (args, kwargs) of each role's worker i, the same in its own actor and in a hybrid
    one."""

    cfg: Config
    envs: Any
    own_processes: bool = False
    """Each worker runs in an actor process of its own (Ray): a rollout actor whose tensor-parallel engine lost a
    worker process then ends, to be replaced like any dead engine."""

    def learner(self, i: int) -> tuple[tuple, dict]:
        cfg = self.cfg
        return (cfg.model, cfg.learner, cfg.loss), dict(
            temperature=cfg.rollout.sampling.temperature, norm_len=cfg.norm_len, mini_batch_size=cfg.mini_batch_size,
            total_optimizer_steps=total_optimizer_steps(cfg), seed=cfg.run.seed, num_gpus=cfg.cluster.learner.num_gpus)

    def rollout(self, i: int, num_gpus: float, sleep_mode: bool = False) -> tuple[tuple, dict]:
        cfg = self.cfg
        return (cfg.rollout, cfg.model), dict(
            max_prompt_tokens=cfg.longest_prompt_tokens, max_new_tokens=cfg.longest_turn_tokens,
            seed=sampling_seed(cfg), num_gpus=num_gpus, environment=cfg.env, envs=self.envs,
            max_restarts=cfg.cluster.recovery.max_restarts, address=node_address, lora=cfg.served_adapters,
            exit_when_lost=self.own_processes, **({"sleep_mode": True} if sleep_mode else {}))

    def reference(self, i: int, num_gpus: float) -> tuple[tuple, dict]:
        cfg = self.cfg
        return (cfg.reference, cfg.model), dict(temperature=cfg.rollout.sampling.temperature, num_gpus=num_gpus)


GROUP_TIMEOUT_MARGIN_S = 300.0
"""How much longer than `cluster.sync_timeout_s` a collective of the learners' (or critics') group may wait."""


def group_timeout_s(cfg: Config) -> float:
    """The collective timeout of the learners' and the critics' process groups: `cluster.sync_timeout_s` plus
    `GROUP_TIMEOUT_MARGIN_S`. The longest legitimate wait in the group is a sharded learner's in the export's
    all-gather while learner 0's NCCL broadcast waits for every engine to finish its chunk, which the push's own
    deadline bounds; so a push that runs late ends with the driver's error naming the engines, not with NCCL's
    watchdog killing the learners (whose default, 10 minutes, is shorter than a long chunk)."""
    return cfg.cluster.sync_timeout_s + GROUP_TIMEOUT_MARGIN_S


def _connect(backend: Backend, group: Any, role: str, free_port, connect, timeout_s: float,
             group_timeout: float) -> None:
    """Join the actors of `group` in one torch.distributed group whose collectives time out after `group_timeout`
    seconds, rendezvous at a free port of actor 0's node."""
    host = group.node_ip(0)
    port = backend.answer(group.call(0, free_port, host), f"{role} 0's free port", timeout_s)
    backend.answer([group.call(i, connect, host, port, i, len(group), group_timeout) for i in range(len(group))],
                   f"the {role}s' process group connection", timeout_s)
