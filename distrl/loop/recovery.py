"""Resuming and recovering: the checkpoint a resumed run starts from and loading it into the roles, checking that
the actors see the run directory, and recovering from a dead learner, reference or critic by starting every role
again from the newest checkpoint. Used by `distrl.driver.train`; saving a step's checkpoint is the last phase of a
step (`distrl.loop.phases.save_checkpoint`).

Above the phases (it works on their `Job`), beside the loops: it imports nothing from them or from `distrl.driver`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrl import checkpoint, preflight
from distrl.cluster.group import ActorGroup
from distrl.cluster.roles import Roles
from distrl.console import say
from distrl.correction_watch import CorrectionWatch
from distrl.loop.phases import Job
from distrl.metrics import BusyClock
from distrl.reward_watch import RewardWatch
from distrl.run_dir import RunDir
from distrl.workers.training.critic import Critic
from distrl.workers.training.learner import Learner


def dead_actors(roles: Roles, error: Exception) -> list[str] | None:
    """When `error` ended the loop: the learner, reference and critic actors that are dead (asked before the roles are
    ended: afterwards every actor is), [] if only the error says that an actor died, None if none did."""
    try:
        groups = {id(g.workers): g for g in (roles.learner, roles.reference, roles.critic) if g is not None}
        dead = [g.name(i) for g in groups.values() for i in g.dead()]  # hybrid roles are views of one group
    except Exception:  # noqa: BLE001 - the question must not hide the error it is asked about
        dead = []
    return dead if dead or roles.backend.lost(error) else None


class RoleDied(Exception):
    """A learner, reference or critic actor died (`names`; empty when only the error says so) and ended the
    roles."""

    def __init__(self, names: list[str], error: Exception):
        super().__init__(f"{', '.join(names) or 'an actor'} died: {error}")
        self.names, self.error = names, error


def recovery_point(job: Job, died: RoleDied, began: int) -> Path | None:
    """The checkpoint to continue from after `died` ended the roles started at step `began` + 1, within
    `cluster.recovery.max_recoveries` (None: it is the final step's, nothing is left to train). Raises the original
    error when no step was trained since the roles started (a failure at start-up would only recur), and a clear
    one when there is no checkpoint or budget left."""
    if job.last_step == began:
        raise died.error from None
    who, budget = ", ".join(died.names) or "an actor", job.cfg.cluster.recovery.max_recoveries
    if job.recoveries >= budget:
        raise RuntimeError(f"{who} died in step {job.last_step + 1}; the run has recovered from a checkpoint "
                           f"{job.recoveries} times already (cluster.recovery.max_recoveries = {budget}). The "
                           f"error: {died.error}") from died.error
    found, refused = checkpoint.resume_point(job.run.path)
    for why in refused:
        say(f"not recovering from a damaged checkpoint, set aside as .damaged: {why}")
    if found is None:
        raise RuntimeError(f"{who} died in step {job.last_step + 1} and the run has no checkpoint to recover from: "
                           f"set run.checkpoint_every to let a run survive a learner or reference failure. The "
                           f"error: {died.error}") from died.error
    failed, step = job.last_step + 1, checkpoint.driver_state(found)["step"]
    if step >= job.cfg.run.steps:
        say(f"{who} died after the final checkpoint (step {step}): the run is complete")
        return None
    job.recoveries += 1
    job.recovered += 1
    del job.history[max(0, len(job.history) - (job.last_step - step)):]  # rows are in step order, one per step
    job.last_step = job.checkpointed = step
    job.timer.pop()  # the phases of the step that failed
    job.learner_clock, job.reference_clock = BusyClock(), BusyClock()
    say(f"{who} died in step {failed} ({type(died.error).__name__}): restarting every role from {found} (recovery "
          f"{job.recoveries} of {budget})")
    return found


def check_shared_run_dir(run: RunDir, roles: Roles) -> None:
    """Every learner (and critic) may write checkpoint files on its node (sharded ones each write their shards) and
    the driver resumes from them: refuse to train unless each sees the run directory the driver made (its
    config.yaml, byte for byte)."""
    config = run.path / "config.yaml"
    writers: list[tuple[ActorGroup, Any]] = [(roles.learner, Learner.seen_digest)]
    if roles.critic is not None:
        writers.append((roles.critic, Critic.seen_digest))
    for group, seen_digest in writers:
        seen = roles.backend.answer(group.map(seen_digest, str(config)), f"the {group.role}s' read of {config}",
                                    run.cfg.cluster.call_timeout_s)
        for i, digest in enumerate(seen):
            if digest != checkpoint.seen_digest(config):
                who = group.name(i)
                raise preflight.PreflightError([
                    f"run.output_dir: {who} does not see the run directory {run.path} that the driver made (its "
                    f"config.yaml is {'missing' if digest is None else 'different'} on {who}'s node), so the driver "
                    f"could not resume from the checkpoints {who} writes. Put run.output_dir on storage that the "
                    f"driver and every learner and critic mount at the same path (NFS, a Kubernetes PVC: see "
                    f"deploy/)"])


def resume_point(run: RunDir) -> Path | None:
    """The checkpoint `run.resume` continues from (None: there is none, start at step 1); says which newer ones
    were refused and why. Raises if checkpoints exist and none is usable."""
    found, refused = checkpoint.resume_point(run.path)
    for why in refused:
        say(f"not resuming from a damaged checkpoint, set aside as .damaged: {why}")
    if found is None and refused:
        raise RuntimeError(f"run.resume: no usable checkpoint in {run.path / 'checkpoints'}; start afresh with "
                           f"run.overwrite=true (and run.resume=false)")
    if found is None:
        say(f"run.resume: {run.path} holds no checkpoint; starting at step 1")
    return found


def restore(found: Path | None, job: Job, roles: Roles) -> None:
    """Load checkpoint `found` (if any; the job is at its step) into every learner, every critic and the prompt
    stream, forget metrics rows logged after it, and watch the reward and the correction from the rows kept."""
    if found:
        roles.backend.answer(roles.learner.map(Learner.load_checkpoint, str(found / "policy"), job.last_step),
                             f"the learners' load of {found}", job.cfg.cluster.call_timeout_s)
        if roles.critic is not None:
            if not (found / "critic").is_dir():
                raise RuntimeError(f"{found} holds no critic part (it was written by a run without a critic); "
                                   f"resume it with the config it was trained with")
            roles.backend.answer(roles.critic.map(Critic.load_checkpoint, str(found / "critic")),
                                 f"the critics' load of {found}", job.cfg.cluster.call_timeout_s)
        job.stream.load_state_dict(checkpoint.driver_state(found)["data"])
        say(f"resumed from {found} (step {job.last_step})")
    kept = job.run.forget_after(job.last_step)
    watch = job.cfg.run.reward_collapse
    job.reward_watch = RewardWatch(watch, (row["reward/mean"] for row in kept)) if watch is not None else None
    alarm = job.cfg.run.correction_alarm
    job.correction_watch = CorrectionWatch(alarm, kept) if alarm is not None else None
