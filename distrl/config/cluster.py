"""`cluster`: actor counts and resources per role, placement, weight sync, timeouts and recovery."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from distrl.config.base import Section

# Ray's syntax for node labels and label selectors (ray._private.label_utils, Kubernetes label rules), repeated here
# because validating a config imports no Ray: a key is an optional DNS-subdomain prefix and a name; a selector value
# is `v`, `!v`, `in(a, b)` or `!in(a, b)`.
_NAME = r"[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?"
LABEL_KEY = re.compile(rf"^(({_NAME})(\.({_NAME}))*/)?{_NAME}$")
LABEL_SELECTOR_VALUE = re.compile(rf"^!?(in\({_NAME}(, ?{_NAME})*\)|{_NAME})$")
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")


class RoleResources(Section):
    num_actors: int = Field(default=1, gt=0)
    """Actors in this role."""
    num_cpus: float = Field(default=1.0, gt=0.0)
    """CPUs reserved per actor."""
    num_gpus: float = Field(default=0.0, ge=0.0)
    """GPUs reserved per actor (0 on a CPU-only machine). An actor computes on one GPU; a fraction is refused where
    two actors sharing a GPU would be ranks of one NCCL group (`distrl.config.gpus`)."""
    num_threads: int | None = Field(default=None, gt=0)
    """Compute threads per actor (OMP_NUM_THREADS, which torch and vLLM's CPU kernels follow). Null: num_cpus
    rounded up, except in the synchronous loop on the embedded cluster, where the roles take turns and each may use
    every core (shared among the actors that run at the same time; see `distrl.cluster.roles.role_threads`)."""
    labels: dict[str, str] = Field(default_factory=dict)
    """Which nodes this role's actors may run on, as a Ray label selector: each key a node label, each value what it
    must be (`v`, `!v`, `in(a, b)` or `!in(a, b)`). Nodes are labelled when they start (`ray start --labels
    '{"pool": "rollout"}'`, or a KubeRay group's `rayStartParams`); Ray's own labels work too
    (`ray.io/accelerator-type`, `ray.io/node-id`). Empty: any node. Every actor of the role and its replacements
    are placed by it."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources each actor reserves beside its CPUs and GPUs, e.g. `{"inference_node": 1}` on nodes
    started with `ray start --resources '{"inference_node": 8}'`: another way to keep a role on the nodes made for
    it (and to cap how many actors one node takes)."""
    accelerator_type: str | None = None
    """The GPU model each actor needs (Ray's accelerator type, as `ray.util.accelerators` names them: `H100`,
    `A100`, `L4`, ...): the actors are placed only on nodes whose GPUs are of that type. Needs num_gpus > 0."""

    @field_validator("labels")
    @classmethod
    def _ray_label_selector(cls, labels: dict[str, str]) -> dict[str, str]:
        for key, value in labels.items():
            if not LABEL_KEY.match(key) or len(key.rsplit("/", 1)[-1]) > 63:
                raise ValueError(f"label {key!r} is not a valid Ray label key (an optional DNS prefix and '/', then "
                                 f"at most 63 letters, digits, '-', '_' or '.', starting and ending with a letter "
                                 f"or digit)")
            if not LABEL_SELECTOR_VALUE.match(value):
                raise ValueError(f"label {key!r}: {value!r} is not a Ray label selector value: write 'v', '!v', "
                                 f"'in(a, b)' or '!in(a, b)', each value at most 63 letters, digits, '-', '_' or '.'")
        return labels

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, resources: dict[str, float]) -> dict[str, float]:
        for name, amount in resources.items():
            if name in RAY_RESOURCES:
                raise ValueError(f"{name!r} is one of Ray's own resources: set it with num_cpus / num_gpus, not "
                                 f"under resources")
            if amount <= 0:
                raise ValueError(f"{name!r}: {amount:g} must be > 0")
        return resources

    @model_validator(mode="after")
    def _accelerator_needs_gpus(self) -> RoleResources:
        if self.accelerator_type is not None and self.num_gpus == 0:
            raise ValueError(f"accelerator_type {self.accelerator_type!r} names a GPU model, but num_gpus is 0")
        return self

    @property
    def placed_by_node(self) -> bool:
        """Whether the role says which nodes it may run on (labels, custom resources or a GPU model)."""
        return bool(self.labels or self.resources or self.accelerator_type)


class RolloutResources(RoleResources):
    """The rollout (vLLM) actors' resources, and the bounds of their number while an asynchronous run goes on: engines
    are producers, scaled apart from the learners."""

    min_actors: int | None = Field(default=None, gt=0)
    """Fewest engines the run keeps. While more than this many serve, an engine that dies (its node lost, its process
    killed) is let go instead of replaced, and the prompts it held go to the others; at this many, a dead engine is
    replaced (`cluster.recovery`). Null: num_actors, so every dead engine is replaced."""
    max_actors: int | None = Field(default=None, gt=0)
    """Most engines the run may have. While fewer serve, one more waits for room (a placement group of one engine's
    resources, with the role's labels): when a node with room joins the cluster (or an autoscaler adds one for that
    waiting demand), the engine starts there, loads the current weights and takes chunks. Asynchronous loop only.
    Null: num_actors, a fixed number of engines."""

    @model_validator(mode="after")
    def _bounds_hold_num_actors(self) -> RolloutResources:
        if self.min_actors is not None and self.min_actors > self.num_actors:
            raise ValueError(f"min_actors ({self.min_actors}) > num_actors ({self.num_actors}): the run starts "
                             f"with num_actors engines")
        if self.max_actors is not None and self.max_actors < self.num_actors:
            raise ValueError(f"max_actors ({self.max_actors}) < num_actors ({self.num_actors}): the run starts "
                             f"with num_actors engines")
        return self

    @property
    def elastic(self) -> bool:
        """Whether the number of engines may change while the run goes on."""
        return (self.min_actors or self.num_actors) < self.num_actors or (self.max_actors or 0) > self.num_actors

    @property
    def fewest(self) -> int:
        return self.min_actors or self.num_actors

    @property
    def most(self) -> int:
        return self.max_actors or self.num_actors


class RecoveryConfig(Section):
    max_restarts: int = Field(default=3, ge=0)
    """Times one rollout actor may be replaced within `window_s` when it dies (process killed, node lost): its
    prompts are re-dispatched and the new actor serves the current weights before it takes any. One more death in
    the window ends the run, naming the actor and its last error. 0: a dead rollout actor ends the run. With the
    NCCL weight sync the replacement joins a new NCCL world; one that dies while a broadcast waits for it ends the
    run (docs/failures.md)."""
    window_s: float = Field(default=3600.0, gt=0.0)
    """Seconds over which `max_restarts` is counted."""
    start_timeout_s: float = Field(default=900.0, gt=0.0)
    """A replacement that does not serve this many seconds after it was started ends the run, naming it: its
    placement bundle may have no node left to run on, or its engine hangs while starting."""
    verdict_timeout_s: float = Field(default=90.0, gt=0.0)
    """How long a rollout actor that Ray cannot reach (its node lost, or cut off) waits for Ray to declare it dead
    before it is replaced anyway. Ray's GCS declares a node dead once its health checks fail: within about 15 s of
    its raylet's end, up to about 65 s with Ray's default health checks when its packets are dropped. A replacement
    started before the verdict would be placed on the lost node's bundle and die there too. Pushes leave the actor
    out meanwhile (under the NCCL weight sync, whose broadcasts need every rank, it is replaced at once)."""
    max_recoveries: int = Field(default=2, ge=0)
    """Times the run may recover from its newest checkpoint when a learner or reference actor dies (every role is
    started again; the steps after the checkpoint are redone). Needs checkpoints (`run.checkpoint_every`);
    0: such a death ends the run."""


class HybridConfig(Section):
    """How the engine and the learner of one hybrid actor (`cluster.colocate: hybrid`) share its GPU. On CPU both stay
    in memory (vLLM's CPU build has no sleep mode) and these settings change nothing."""

    sleep_level: Literal[1, 2] | None = None
    """How the engine sleeps while the learner scores and trains: 1 moves its weights to CPU memory and releases its
    KV cache; 2 also discards the weights, which the next weight push loads anyway (vLLM's own advice for RL). Null:
    2 when every push carries every weight (full fine-tuning), 1 when pushes carry LoRA adapters only (the base
    weights must survive the sleep)."""
    offload_optimizer: bool = True
    """Move the optimizer's state to CPU memory while the engine generates (and back before the update): on a 7B
    model AdamW's fp32 moments are about 61 GB, unsharded, which the engine's KV cache can use meanwhile."""


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
    rollout: RolloutResources = Field(default_factory=lambda: RolloutResources(num_cpus=1.0))
    """Rollout (vLLM) actors, and the bounds of their number in an asynchronous run (`min_actors`, `max_actors`)."""
    learner: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=1.0))
    """Learner actors (data-parallel)."""
    reference: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.5))
    """Reference actors. With a KL term and learners on GPUs, `num_gpus` left out is the learners' (the reference
    runs on a GPU of its own); set it to 0 to keep the reference on the CPU."""
    critic: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=1.0))
    """Critic actors (data-parallel like the learners; only with a `critic` section)."""
    env: RoleResources = Field(default_factory=lambda: RoleResources(num_cpus=0.25))
    """Environment actors (only with an `env` section): each hosts many episodes' environments at once."""
    colocate: Literal["none", "pack", "hybrid"] = "none"
    """Where the roles run. `none`: each role in a placement group of its own (PACK). `pack`: every role's actors in
    one placement group (PACK over the whole job), still one actor, and its own GPUs, per role. `hybrid`: each learner
    actor also hosts a vLLM engine and (with a KL term) the reference model, in its own process on its own device:
    the phases take turns inside the actor and weights pass to the engine in memory, bucket by bucket (on GPUs the
    engine sleeps while the learner works: `cluster.hybrid`). The hybrid actors take `cluster.learner`'s resources;
    `cluster.rollout` and `cluster.reference` are not used. `true` and `false` read as `pack` and `none`."""
    hybrid: HybridConfig = Field(default_factory=HybridConfig)
    """How a hybrid actor's engine and learner share its GPU (`colocate: hybrid` only)."""
    weight_sync: Literal["auto", "object_store", "nccl"] = "auto"
    """Learner -> rollout weight transport: `auto` is nccl when learners and rollout actors have GPUs and the pushes
    carry full weights, else the Ray object store (which always carries `learner.lora`'s adapters); in hybrid mode
    (`colocate: hybrid`) the weights pass in the actor's own memory, and only `auto` is accepted."""
    sync_bucket_bytes: int = Field(default=64 * 2**20, gt=0)
    """Weights travel in buckets of about this many bytes."""
    sync_timeout_s: float = Field(default=1800.0, gt=0.0)
    """A weight push that has not reached every engine this many seconds after it started ends the run with an
    error naming the engines (and, with NCCL, learner 0's broadcast) instead of waiting for ever: a hung engine, or a
    collective waiting for a dead peer. In the asynchronous loop a push waits behind the chunk each engine runs.
    With NCCL it also bounds the engines' start-up before the weight-sync world forms and that world's rendezvous,
    and the learners' and critics' collectives time out this plus 300 s after they start (NCCL's watchdog)."""
    placement_timeout_s: float = Field(default=600.0, gt=0.0)
    """How long the run's start waits for the cluster to place every role's actors (its placement groups) before it
    ends with an error naming the roles that wait, what their actors need and the cluster's nodes. An autoscaler
    adding nodes for them takes minutes. (Roles started again after a death wait `recovery.start_timeout_s`.)"""
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

    @field_validator("colocate", mode="before")
    @classmethod
    def _colocate_was_a_switch(cls, value: Any) -> Any:
        return {True: "pack", False: "none"}.get(value, value) if isinstance(value, bool) else value

    @property
    def hybrid_mode(self) -> bool:
        """Whether each learner actor hosts the engine and the reference too (`colocate: hybrid`)."""
        return self.colocate == "hybrid"
