"""The asynchronous loop (`loop.mode: async`): the same phases as the synchronous one, but the rollout actors never
wait for the learners.

While the learners update on batch s, the producer keeps generating chunks for the next batches, admitted only
while their samples can still be trained within `loop.max_staleness` (see `distrl.cluster.producer`); the
reference scores batch s + 1 as soon as it is full. When the update ends, its weights are pushed without waiting
(each engine loads them between two chunks), then the learners score batch s + 1 (its old log-probs: the proximal
policy, the weights the update of s + 1 starts from; part of the update itself when it is one optimizer step) and
update on it.

The objective stays decoupled PPO: the PPO ratio is taken against the learners' old log-probs, and the configured
correction (TIS / ICEPop / seq-mask-TIS) bridges the behaviour policy (the possibly stale engine that sampled) to
them. A row's `time/*` figures are what the driver waited for since the previous row.

Like the synchronous loop it runs the phases of `distrl.loop.phases`, and imports nothing else from `distrl.loop` or
`distrl.driver`.
"""

from __future__ import annotations

from dataclasses import dataclass

from distrl.batching import pad
from distrl.cluster.batch_stats import BatchStats
from distrl.cluster.weight_sync import PendingSync
from distrl.loop.phases import (
    Job,
    Updating,
    complete_batch,
    end_step,
    evaluate,
    finish_update,
    start_old_logprobs,
    start_reference,
    start_unreplayed_logprobs,
    start_update,
    start_values,
)
from distrl.types.batches import TrainBatch
from distrl.types.rollouts import ScoredRollouts


@dataclass
class InFlight:
    """An update the learners are running, with what its row needs."""

    step: int
    handles: Updating
    batch: TrainBatch
    scored: ScoredRollouts
    produced: BatchStats
    metrics: dict[str, float]


def train_async(job: Job, steps) -> None:
    timer = job.timer
    update: InFlight | None = None
    push: PendingSync | None = None
    for step in steps:
        with timer("generate"):
            scored, produced = job.producer.next_batch(step)
        sequences = pad(scored.rollouts, job.pad_id)
        ref = start_reference(job, sequences)  # while the learners are still on the previous batch
        if update is not None:
            push = finish(job, update, push)
        batch, metrics = complete_batch(job, scored, sequences, ref, start_old_logprobs(job, sequences),
                                        start_values(job, sequences), step, start_unreplayed_logprobs(job, sequences))
        update = InFlight(step, start_update(job, batch), batch, scored, produced, metrics)
    if update is not None:
        push = finish(job, update, push)
    if push is not None:
        job.roles.sync.finish(push)


def finish(job: Job, update: InFlight, push: PendingSync | None) -> PendingSync | None:
    """Wait for `update`, start pushing its weights (the engines switch between chunks), log its row; the push
    is waited for here when an evaluation of those weights is due (then None is returned)."""
    with job.timer("update"):
        update.metrics.update(finish_update(job, update.handles, update.batch, update.step))
    with job.timer("sync"):
        sync = job.roles.sync.finish(push) if push is not None else None  # the previous push, long done by now
        if sync is not None:
            job.producer.lost_in_push(sync.lost)  # replaced before this push, so that it reaches the new engines
        started = job.roles.sync.start(version=update.step, skip=job.producer.starting())
        job.producer.set_version(update.step)
        pending: PendingSync | None = started
        if job.evaluator is not None and job.evaluator.due(update.step):
            # An evaluation is of the weights of its step: they are in every engine before it starts.
            job.producer.lost_in_push(job.roles.sync.finish(started).lost)
            pending = None
    update.metrics.update(evaluate(job, update.step))
    end_step(job, update.step, update.scored, update.batch, update.produced, update.metrics, sync)
    return pending
