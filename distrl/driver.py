"""`train(cfg)`: the RL loop. Build the roles, push weights once, then each step:
prompts -> generate (+ score) -> reference and old log-probs -> advantages -> update -> sync -> log -> maybe checkpoint.
"""

from __future__ import annotations

from contextlib import ExitStack, closing
from pathlib import Path

import ray
import torch

from distrl import checkpoint, preflight
from distrl.batching import assign_advantages, to_train_batch
from distrl.cluster import runtime
from distrl.cluster.generation import generate
from distrl.cluster.group import ActorGroup
from distrl.cluster.rewards import collect as collect_rewards
from distrl.cluster.roles import Roles, started_roles
from distrl.config import Config
from distrl.data import PromptIterator, load_prompts
from distrl.metrics import PhaseTimer
from distrl.run_dir import RunDir
from distrl.types import TrainBatch
from distrl.workers.learner import Learner, merge_metrics
from distrl.workers.model import load_tokenizer
from distrl.workers.reference import ReferenceWorker


def train(cfg: Config) -> list[dict]:
    """Run `cfg.run.steps` steps; returns every step's metrics (also in RUN_DIR/metrics.jsonl)."""
    preflight.check(cfg)  # model, data, reward and run directory, before Ray or any actor starts
    with ExitStack() as cleanup:
        run = cleanup.enter_context(closing(RunDir(cfg)))
        ray_session = cleanup.enter_context(closing(runtime.Connection(cfg.cluster)))
        print(ray_session.description)
        tokenizer = load_tokenizer(cfg.model)
        prompts, data_stats = load_prompts(cfg.data, tokenizer)
        batches = PromptIterator(prompts, cfg.rollout.prompts_per_step, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        found = checkpoint.latest(run.path) if cfg.run.resume else None
        done = checkpoint.driver_state(found) if found else {"step": 0}
        roles = cleanup.enter_context(started_roles(cfg, first_step=done["step"] + 1))
        restore(found, done, run, roles, batches)
        roles.sync.push(version=done["step"])
        timer, history = PhaseTimer(), []
        for step in run.progress(range(done["step"] + 1, cfg.run.steps + 1)):
            with timer("generate"):
                rollouts, scoring = generate(roles.rollout, next(batches), cfg.reward)
            with timer("score"):  # what is left of the reward tasks once the last response is in
                rewards, reward_errors = collect_rewards(scoring)
            batch = to_train_batch(rollouts, tokenizer.pad_token_id)
            add_logprobs(roles, batch, cfg.algorithm.old_logprobs, timer)
            with timer("advantages"):
                adv_metrics = assign_advantages(batch, torch.tensor(rewards), cfg.rollout.n_samples_per_prompt,
                                                cfg.algorithm, cfg.loss.kl)
            with timer("update"):
                update_metrics = update(roles, batch, cfg.mini_batch_size)
            with timer("sync"):
                sync = roles.sync.push(version=step)
            metrics = run.step_metrics(step, rollouts, rewards, reward_errors, adv_metrics, update_metrics, sync,
                                       timer.pop(), data_stats)
            history.append(metrics)
            run.log(step, metrics)
            # After the row is written, so a checkpoint's step always has its row; its time shows in the next row.
            if run.checkpoint_due(step):
                with timer("checkpoint"):
                    path = str(checkpoint.path_for(run.path, step))
                    ray.get(roles.learner.call(0, Learner.save_checkpoint, path,
                                               {"step": step, "data": batches.state_dict()}))
    run.summary(history)  # after the actors are gone, so their last log lines do not trail it
    return history


def add_logprobs(roles: Roles, batch: TrainBatch, old_logprobs: str, timer: PhaseTimer) -> None:
    """Set `batch.ref_logprobs` (None when no KL term needs them) and `batch.old_logprobs`: the learners' own
    log-probs before the update (`recompute`, decoupled PPO) or vLLM's (`rollout`, bypass mode).

    Both run at once, on the reference actors and on the learners, row shards spread evenly over each group;
    `time/reference` and `time/old_logprobs` are the waits for each in turn."""
    ref_shards = _shard_calls(roles.reference, ReferenceWorker.logprobs, batch) if roles.reference else None
    old_shards = _shard_calls(roles.learner, Learner.logprobs, batch) if old_logprobs == "recompute" else None
    with timer("reference"):
        batch.ref_logprobs = torch.cat(ray.get(ref_shards)) if ref_shards else None
    with timer("old_logprobs"):
        batch.old_logprobs = torch.cat(ray.get(old_shards)) if old_shards else batch.rollout_logprobs


def _shard_calls(group: ActorGroup, method, batch: TrainBatch) -> list[ray.ObjectRef]:
    shards = batch.split(min(len(group), batch.batch_size))
    return [group.call(i, method, shard) for i, shard in enumerate(shards)]


def update(roles: Roles, batch: TrainBatch, mini_batch_size: int) -> dict[str, float]:
    """One update on every learner, each on its part of every mini-batch; metrics merged over learners."""
    shards = batch.shard(len(roles.learner), mini_batch_size)
    return merge_metrics(ray.get(roles.learner.map_shards(Learner.update, shards)))


def restore(found: Path | None, state: dict, run: RunDir, roles: Roles, batches: PromptIterator) -> None:
    """Load checkpoint `found` (if any; `state` is its driver state) into every learner and the data iterator, and
    forget metrics rows logged after it."""
    if found:
        ray.get(roles.learner.map(Learner.load_checkpoint, str(found)))
        batches.load_state_dict(state["data"])
        print(f"resumed from {found} (step {state['step']})")
    run.forget_after(state["step"])
