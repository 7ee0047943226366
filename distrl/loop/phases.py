"""The phases of one training step, which both loops run (`distrl.loop.sync`, `distrl.loop.asynchronous`): score
the batch with the reference, the learners' old log-probs and the critic's values, complete it with advantages,
update (the policy's, and the critic's beside it), then end the step: log its row and checkpoint it when due.

Each phase starts calls and returns their handles, or waits for handles another started, so that a loop decides what
overlaps. `Job` is what they work on. The floor below the loops: this module imports nothing from `distrl.loop` or
`distrl.driver`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from distrl import checkpoint, merging
from distrl.algo import metrics_by_staleness, mismatch_metrics
from distrl.batching import advantages, gae_advantages, select_by_covariance
from distrl.cluster import rewards
from distrl.cluster.batch_stats import BatchStats, staleness_metrics, token_age_metrics
from distrl.cluster.group import ActorGroup
from distrl.cluster.producer import Producer
from distrl.cluster.roles import Roles
from distrl.cluster.weight_sync import SyncStats
from distrl.config import ClipCovConfig, Config, KLCovConfig
from distrl.console import say
from distrl.correction_watch import CorrectionWatch
from distrl.data.stream import PromptStream
from distrl.evaluation import write_samples
from distrl.evaluator import Evaluator
from distrl.metrics import BusyClock, PhaseTimer
from distrl.reward_watch import RewardWatch
from distrl.run_dir import RunDir
from distrl.types.batches import Sequences, TrainBatch, in_row_order
from distrl.types.prompt import Prompt
from distrl.types.rollouts import Rollouts, ScoredRollouts
from distrl.workers.rewards import Scores
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.training.critic import Critic
from distrl.workers.training.learner import Learner
from distrl.workers.training.reference import ReferenceWorker


@dataclass
class Job:
    """What both loops work with: the config, the run directory, the prompt stream and what the run has logged,
    which last for the whole run, and the roles and producer, which are started anew when the run recovers from a
    checkpoint."""

    cfg: Config
    stream: PromptStream
    run: RunDir
    pad_id: int
    data_stats: Any
    roles: Roles = field(init=False)
    producer: Producer = field(init=False)
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    history: list[dict] = field(default_factory=list)
    learner_clock: BusyClock = field(default_factory=BusyClock)
    reference_clock: BusyClock = field(default_factory=BusyClock)
    last_step: int = 0  # the newest step whose row is written
    checkpointed: int = 0  # the newest step checkpointed in this run
    recoveries: int = 0  # from a checkpoint, in this run
    recovered: int = 0  # of them, those not yet reported in a row
    evaluator: Evaluator | None = None  # the held-out sets (`eval`)
    reward_watch: RewardWatch | None = None  # `run.reward_collapse`, over the rows logged (`restore` makes it)
    correction_watch: CorrectionWatch | None = None  # `run.correction_alarm`, likewise



def data_groups(job: Job, role: str = "learner") -> int:
    """The data-parallel groups of `role` ("learner", "critic" or "reference"): with its `sequence_parallel_size` k,
    each k actors share every micro-batch of one part of the batch."""
    group = getattr(job.roles, role)  # the Roles field of that name
    assert group is not None
    return len(group) // sequence_parallel(job, role)


def sequence_parallel(job: Job, role: str) -> int:
    """k of `role`: `learner.sequence_parallel_size`, the critic's or the reference's."""
    section = getattr(job.cfg, role)  # the config section of that name
    assert section is not None
    return section.sequence_parallel_size


def to_learners(job: Job, parts: list[Any], role: str = "learner") -> list[Any]:
    """Each data-parallel group's part, once for each of its actors (in rank order: a group is k consecutive
    ranks, `distrl.workers.training.dist`)."""
    return [part for part in parts for _ in range(sequence_parallel(job, role))]


def one_per_group(job: Job, answers: list[Any], role: str = "learner") -> list[Any]:
    """The answer of the first actor of each data-parallel group: its k actors answer the same (counted k times, a
    group's tokens and loss would weigh k-fold)."""
    return answers[::sequence_parallel(job, role)]


def start_reference(job: Job, sequences: Sequences) -> list[Any] | None:
    """Reference log-probs, row shards spread evenly: on the reference actors, or with `learner.lora` on the
    learners, whose base model with the adapters disabled is the reference (None without a KL term)."""
    if not job.cfg.needs_ref_logprobs:
        return None
    if job.roles.reference is None:  # learner.lora
        job.learner_clock.start()
        shards = sequences.split(min(data_groups(job), sequences.batch_size))
        return job.roles.learner.map_shards(Learner.ref_logprobs, to_learners(job, shards))
    job.reference_clock.start()
    shards = sequences.split(min(data_groups(job, "reference"), sequences.batch_size))
    return job.roles.reference.map_shards(ReferenceWorker.logprobs, to_learners(job, shards, "reference"))


def start_old_logprobs(job: Job, sequences: Sequences) -> list[Any] | None:
    """The learners' own log-probs before the update (decoupled PPO's proximal policy), row shards spread evenly;
    None in bypass mode (`algorithm.old_logprobs: rollout`), where the sampler's stand in, and when the update takes
    them from its own forward pass (`Config.old_logprobs_in_update`)."""
    if job.cfg.algorithm.old_logprobs == "rollout" or job.cfg.old_logprobs_in_update:
        return None
    job.learner_clock.start()
    shards = sequences.split(min(data_groups(job), sequences.batch_size))
    return job.roles.learner.map_shards(Learner.logprobs, to_learners(job, shards))


def start_unreplayed_logprobs(job: Job, sequences: Sequences) -> list[Any] | None:
    """With routing replay (the batch carries routes), the learners' log-probs of the batch before the update with
    each router choosing its own experts, as without replay: the mismatch replay leaves against the one it removes
    (`mismatch_figures`). One more forward pass without gradient per step; None without routes, and in bypass mode
    (no learner log-probs to compare with)."""
    if sequences.routes is None or job.cfg.algorithm.old_logprobs == "rollout":
        return None
    job.learner_clock.start()
    plain = replace(sequences, routes=None, routed=None)
    shards = plain.split(min(data_groups(job), plain.batch_size))
    return job.roles.learner.map_shards(Learner.logprobs, to_learners(job, shards))


def mismatch_figures(sequences: Sequences, logprobs: torch.Tensor, replay: str) -> dict[str, float]:
    """`correction/mismatch_{kl,k3}/<replay>`: the rollout/trainer mismatch (`mismatch_metrics`) of the learners'
    log-probs `[B, T]` of the batch before the update, with the engine's routes replayed (`replay` "replayed") or
    without them ("unreplayed")."""
    return {f"correction/{key}/{replay}": float(value) for key, value in
            mismatch_metrics(logprobs, sequences.rollout_logprobs, sequences.response_mask).items()}


def start_values(job: Job, sequences: Sequences) -> list[Any] | None:
    """The critic's values before the update (GAE's V), row shards spread evenly over the critics (None without a
    critic)."""
    if job.roles.critic is None:
        return None
    shards = sequences.split(min(data_groups(job, "critic"), sequences.batch_size))
    return job.roles.critic.map_shards(Critic.values, to_learners(job, shards, "critic"))


def complete_batch(job: Job, scored: ScoredRollouts, sequences: Sequences, ref: list[Any] | None,
                   old: list[Any] | None, values: list[Any] | None, step: int, unreplayed: list[Any] | None = None,
                   ) -> tuple[TrainBatch, dict[str, float]]:
    """Wait for the reference and old log-probs and the critic's values (the engines keep generating meanwhile),
    compute advantages (and, for Clip-Cov and KL-Cov, their tokens over each mini-batch): the complete `TrainBatch`
    of `step`, and its advantage, staleness and per-staleness correction metrics (and with `unreplayed`, the old
    log-probs without routes: `start_unreplayed_logprobs`, the split of the mismatch). `time/reference`,
    `time/old_logprobs` and `time/values` are the waits for each in turn."""
    cfg = job.cfg
    ref_logprobs: torch.Tensor | None = None
    with job.timer("reference"):
        if ref:
            answering = job.roles.reference or job.roles.learner  # learner.lora: the learners' base model
            parts = job.producer.wait_for(ref, calls(answering, "reference log-probs", ref))
            ref_logprobs = torch.cat(one_per_group(job, parts, "learner" if job.roles.reference is None
                                                   else "reference"))
            if job.roles.reference is not None:
                job.reference_clock.stop()
            elif not old:  # else the learners go on with the old log-probs, waited for next
                job.learner_clock.stop()
    with job.timer("old_logprobs"):
        old_logprobs, replay = wait_old_logprobs(job, sequences, old, unreplayed)
    old_values: torch.Tensor | None = None
    if values:
        with job.timer("values"):
            old_values = torch.cat(one_per_group(job, job.producer.wait_for(values, calls(job.roles.critic, "values",
                                                                                          values)), "critic"))
    returns: torch.Tensor | None = None
    with job.timer("advantages"):
        rewards = torch.tensor(scored.rewards)
        if old_values is not None:
            adv, returns, metrics = gae_advantages(rewards, sequences.response_mask, old_values, old_logprobs,
                                                   ref_logprobs, cfg.algorithm, cfg.loss.kl)
        else:
            adv, metrics = advantages(rewards, sequences.response_mask, old_logprobs, ref_logprobs,
                                      cfg.rollout.n_samples_per_prompt, cfg.algorithm, cfg.loss.kl,
                                      episode=torch.tensor(scored.rollouts.episode_index(), dtype=torch.long))
        metrics.update(staleness_metrics(scored.rollouts.policy_version, step))
        metrics.update(token_age_metrics(scored.rollouts.token_versions, scored.rollouts.loss_mask, step))
        if old_logprobs is not None:
            metrics.update(correction_by_staleness(job, sequences, old_logprobs, step))
        metrics.update(replay)
        cov_selected = None
        if isinstance(cfg.loss.policy, ClipCovConfig | KLCovConfig):  # old log-probs are scored before for these
            assert old_logprobs is not None
            # the run's seed and the step seed Clip-Cov's draws: a resumed or redone step draws the same tokens
            cov_selected = select_by_covariance(old_logprobs, adv, sequences.response_mask, cfg.loss.policy,
                                                cfg.mini_batches, seed=cfg.run.seed * 1_000_003 + step)
    return TrainBatch(sequences, old_logprobs=old_logprobs, advantages=adv, ref_logprobs=ref_logprobs,
                      old_values=old_values, returns=returns, cov_selected=cov_selected), metrics


def wait_old_logprobs(job: Job, sequences: Sequences, old: list[Any] | None, unreplayed: list[Any] | None,
                      ) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The old log-probs `[B, T]` of `start_old_logprobs` (the sampler's in bypass mode; None when the update takes
    them from its own forward pass), and with routing replay the mismatch with the routes replayed and without
    (`mismatch_figures`; those of `start_unreplayed_logprobs`)."""
    old_logprobs: torch.Tensor | None = None
    replay: dict[str, float] = {}
    if old:
        old_logprobs = torch.cat(one_per_group(job, job.producer.wait_for(old, calls(job.roles.learner,
                                                                                     "old log-probs", old))))
        if sequences.routes is not None:
            replay.update(mismatch_figures(sequences, old_logprobs, "replayed"))
    elif job.cfg.algorithm.old_logprobs == "rollout":
        old_logprobs = sequences.rollout_logprobs
    if unreplayed:
        plain = job.producer.wait_for(unreplayed, calls(job.roles.learner, "log-probs without routes", unreplayed))
        replay.update(mismatch_figures(sequences, torch.cat(one_per_group(job, plain)), "unreplayed"))
    if old or unreplayed:
        job.learner_clock.stop()
    return old_logprobs, replay


def correction_by_staleness(job: Job, sequences: Sequences, old_logprobs: torch.Tensor, step: int,
                            ) -> dict[str, float]:
    """`correction/<metric>/staleness_<bucket>`: the mismatch and IS-weight figures of `step`'s tokens (old
    log-probs `[B, T]`) split by how many versions behind the update's the weights that sampled each were (a
    multi-turn episode's turns may come from different versions)."""
    lag = step - 1 - sequences.response_versions
    return {f"correction/{k.removeprefix('is_')}/staleness_{bucket}": float(v)
            for bucket, values in metrics_by_staleness(old_logprobs, sequences.rollout_logprobs,
                                                       sequences.response_mask, lag, job.cfg.loss.correction).items()
            for k, v in values.items()}


@dataclass
class Updating:
    """The update calls of one step: the learners', the rows of the batch each learner (data-parallel group) was given
    (`TrainBatch.shard_rows`), and the critics' calls running beside them (None without a critic)."""

    learner: list[Any]
    learner_rows: list[torch.Tensor]
    critic: list[Any] | None


def start_update(job: Job, batch: TrainBatch) -> Updating:
    """One update on every learner, each on its part of every mini-batch; with a critic, its update on the same
    batch at the same time. The config's number of mini-batches holds whatever the batch's row count (episodes of
    several sequences make it vary): `TrainBatch.shard` cuts the rows into that many near-equal ones, and deals each
    one's rows to the learners by their tokens, longest first (balanced); with sequence parallelism, to the
    data-parallel groups, each group's learners getting the same part (`to_learners`)."""
    job.learner_clock.start()
    groups, mini_batches = data_groups(job), job.cfg.mini_batches
    rows = batch.shard_rows(groups, mini_batches)  # kept: the groups' per-row results come back in this order
    learner = job.roles.learner.map_shards(Learner.update, to_learners(job, batch.shard(groups, mini_batches, rows)))
    critic = None
    if job.roles.critic is not None:
        parts = batch.shard(data_groups(job, "critic"), job.cfg.critic_mini_batches)
        critic = job.roles.critic.map_shards(Critic.update, to_learners(job, parts, "critic"))
    return Updating(learner, rows, critic)


def finish_update(job: Job, handles: Updating, batch: TrainBatch, step: int) -> dict[str, float]:
    """Wait for the update of `step` on `batch` (the engines keep generating meanwhile); metrics merged over
    learners (and critics), and the correction by staleness where the update took the old log-probs from its own
    forward pass."""
    results = one_per_group(job, job.producer.wait_for(handles.learner, calls(job.roles.learner, "update",
                                                                               handles.learner)))
    job.learner_clock.stop()
    figs = merging.merge(results, [r["learner/tokens"].value for r in results])
    if handles.critic:
        critics = one_per_group(job, job.producer.wait_for(handles.critic, calls(job.roles.critic, "update",
                                                                                 handles.critic)), "critic")
        figs.update(merging.merge(critics, [r["critic/tokens"].value for r in critics]))
    metrics = merging.values(figs)
    if batch.old_logprobs is None:
        # Learner k's proximal log-probs are of its shard's rows, which the shard dealt by length (TrainBatch.shard).
        old = in_row_order(one_per_group(job, job.roles.backend.answer(
            job.roles.learner.map(Learner.proximal_logprobs), "the learners' proximal log-probs",
            job.cfg.cluster.call_timeout_s)), handles.learner_rows)
        metrics.update(correction_by_staleness(job, batch.sequences, old, step))
        if batch.sequences.routes is not None:
            metrics.update(mismatch_figures(batch.sequences, old, "replayed"))
    return metrics


def evaluate(job: Job, step: int) -> dict[str, float]:
    """The held-out sets' figures of the weights of `step` when `eval` says it is due (else none); every sample is
    written to RUN_DIR/eval/<set>/step_<N>.jsonl. The prompts are spread over the rollout actors in contiguous
    parts, and waited for through the producer: in the asynchronous loop (which has waited for the step's push)
    the engines go on with training chunks beside them, an evaluation's episodes joining the engines' batches.
    `eval/<set>/policy_version` is the oldest version that sampled a token. Its time is `time/eval`."""
    if job.evaluator is None or not job.evaluator.due(step):
        return {}
    group, backend, cfg = job.roles.rollout, job.roles.backend, job.cfg
    assert cfg.eval is not None
    sampling = cfg.eval.sampling

    def generate(prompts: list[Prompt], tickets: list[int]) -> Rollouts:
        engines = group.active()
        parts = min(len(engines), len(prompts))
        bounds = [round(i * len(prompts) / parts) for i in range(parts + 1)]
        handles = [group.call(i, RolloutWorker.generate, prompts[a:b], tickets[a:b], sampling)
                   for i, (a, b) in zip(engines, pairwise(bounds), strict=False)]
        return Rollouts.concat(job.producer.wait_for(handles, calls(group, "evaluation", handles)))

    def score(spec: str, items: list[tuple[str, str, dict]]) -> Scores:
        return rewards.collect(backend, rewards.submit(backend, cfg.reward.model_copy(update={"function": spec}),
                                                       items))

    with job.timer("eval"):
        figures, samples = job.evaluator.run(generate, score)
        for name, part in samples.items():
            write_samples(job.run.path / "eval" / name / f"step_{step:06d}.jsonl", part)
    return figures


def end_step(job: Job, step: int, scored: ScoredRollouts, batch: TrainBatch, produced: BatchStats,
             metrics: dict[str, float], sync: SyncStats | None) -> None:
    """The step's samples are trained on: mark its prompts consumed, log its row, write a few samples to read when
    due, checkpoint if due."""
    every = job.cfg.run.samples_every
    if every and step % every == 0:
        job.run.write_samples(step, readable_samples(job, scored, batch, job.cfg.run.samples_per_write))
    job.stream.consume(scored.rollouts.group)
    metrics.update(produced.metrics())
    metrics["faults/recoveries"], job.recovered = float(job.recovered), 0
    metrics["idle/learner"] = job.learner_clock.pop_idle()
    if job.roles.reference is not None:
        metrics["idle/reference"] = job.reference_clock.pop_idle()
    row = job.run.step_metrics(step, scored, metrics, sync, job.timer.pop(), job.data_stats)
    if job.reward_watch is not None and (reward := row["reward/mean"]) is not None:
        figures, warning = job.reward_watch.observe(reward)
        row.update(figures)
        if warning:
            say(f"warning: step {step}: {warning}")
    if job.correction_watch is not None:
        figures, warnings = job.correction_watch.observe(row)
        row.update(figures)
        for warning in warnings:
            say(f"warning: step {step}: {warning}")
    job.history.append({"step": step, **row})
    job.run.log(step, row)
    job.last_step = step
    # After the row is written, so a checkpoint's step always has its row; its time shows in the next row.
    if job.run.checkpoint_due(step):
        with job.timer("checkpoint"):
            save_checkpoint(job)


def readable_samples(job: Job, scored: ScoredRollouts, batch: TrainBatch, count: int) -> list[dict[str, Any]]:
    """The first `count` episodes of the step (their first sequence): prompt, completion, reward, and the
    advantage they were trained with (of their first trained token; 0 for a response with none)."""
    rollouts, out = scored.rollouts, []
    for a, _ in rollouts.episode_bounds()[:count]:
        trained = batch.sequences.response_mask[a].nonzero()
        advantage = float(batch.advantages[a, trained[0, 0]]) if len(trained) else 0.0
        out.append({"prompt": job.stream.prompt(rollouts.group[a]).text, "completion": rollouts.response_texts[a],
                    "reward": scored.rewards[a], "advantage": advantage, "ticket": rollouts.group[a],
                    "policy_version": rollouts.policy_version[a], "finish_reason": rollouts.finish_reasons[a]})
    return out


def save_checkpoint(job: Job) -> Path:
    """Checkpoint the last finished step: every learner (and critic) writes its part into a temporary directory and
    answers with the files it wrote, then the driver completes it from those lists (`checkpoint.finish`) and prunes
    the older ones."""
    path = checkpoint.path_for(job.run.path, job.last_step)
    tmp = checkpoint.begin(path)
    dtype = job.cfg.rollout.dtype  # the HF copies in the dtype the engines serve (distrl.workers.weights.hf_export)
    parts = {"policy": job.roles.backend.answer(
        job.roles.learner.map(Learner.save_checkpoint, str(tmp / "policy"), dtype),
        f"the learners' checkpoint of step {job.last_step}", job.cfg.cluster.call_timeout_s)}
    if job.roles.critic is not None:
        parts["critic"] = job.roles.backend.answer(
            job.roles.critic.map(Critic.save_checkpoint, str(tmp / "critic"), dtype),
            f"the critics' checkpoint of step {job.last_step}", job.cfg.cluster.call_timeout_s)
    checkpoint.finish(tmp, {"step": job.last_step, "data": job.stream.state_dict()}, parts)
    checkpoint.prune(job.run.path, job.cfg.run.keep_checkpoints)
    job.checkpointed = job.last_step
    return path


def calls(group: ActorGroup | None, what: str, handles: list[Any] | None) -> list[str]:
    """Names of the calls `handles` made on `group` one per active actor, in order (`map`, `map_shards`), for their
    time limit."""
    return [f"{group.name(i)}'s {what}" for i in group.active()[:len(handles or [])]] if group is not None else []
