"""Hybrid mode for real (`cluster.colocate: hybrid`: Ray actors that each hold a learner, a vLLM CPU engine and the
reference): with two actors it gives the rows of the same run with every role apart; the asynchronous loop runs in
it one step off at most, with dynamic sampling in one actor and with two FSDP learners; it evaluates held-out sets
and resumes exactly; a hybrid actor killed mid-run is a learner death, recovered from the newest checkpoint. LoRA in
hybrid actors (trained and resumed as apart) is tested in test_lora_run.py."""

import json
import os

import pytest

from distrl.driver import train

from .conftest import outcome, quickstart, start_quickstart
from .faults import finish, kill_actor, wait_for_checkpoint

TWO = ("cluster.learner.num_actors=2", "cluster.learner.num_cpus=0.5", "learner.micro_batch_size=16",
       "rollout.prompts_per_step=4", "run.steps=4", "run.checkpoint_at_end=false")


def test_two_hybrid_actors_give_the_rows_of_the_roles_apart(ray_session, tmp_path):
    """Two engines (one per hybrid actor) against one engine apart: same seeds per prompt, so the same samples;
    same learners; the in-memory push against the object store's (both verified by the fingerprint check)."""
    apart = train(quickstart(tmp_path / "apart", *TWO))
    hybrid = train(quickstart(tmp_path / "hybrid", *TWO, "cluster.colocate=hybrid"))
    keys = ["reward/mean", "loss/policy", "loss/kl", "learner/tokens", "learner/grad_norm"]
    assert [[h[k] for k in keys] for h in hybrid] == [[h[k] for k in keys] for h in apart]
    assert all(h["time/sync"] > 0 for h in hybrid)


@pytest.mark.parametrize("learners", [1, 2])
def test_the_asynchronous_hybrid_loop_is_one_step_off(ray_session, tmp_path, learners):
    # One actor also filters its groups (dynamic sampling), which sends it more chunks than batches; two are FSDP
    # learners (two replicas run in the synchronous test above).
    one = ("rollout.prompts_per_step=4", "run.steps=4", "learner.micro_batch_size=8",
           "reward.function=tests.binary_rewards:has_digit", "rollout.dynamic_sampling.max_rounds=20")
    extra = (*TWO, "learner.strategy.type=fsdp") if learners == 2 else one
    history = train(quickstart(tmp_path, *extra, "cluster.colocate=hybrid", "loop.mode=async", "loop.max_staleness=1"))
    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(h["learner/tokens"] > 0 for h in history)
    assert all(h["staleness/max"] <= 1 for h in history)
    assert any(h["staleness/max"] == 1 for h in history)  # the engines generated the next batch before the push
    if learners == 1:
        assert sum(h["dynamic_sampling/filtered_groups"] for h in history) > 0
        assert all(h["reward/std"] > 0 for h in history)
    else:  # the FSDP learners trained: the policy moved
        assert len({h["reward/mean"] for h in history}) > 1


def test_a_hybrid_run_evaluates_and_resumes_exactly(ray_session, tmp_path):
    """The held-out evaluation runs on the hybrid actor's engine with the step's weights, and a run cut after an
    unsaved step, resumed from its checkpoint (learner, optimizer, data position; the engine loaded by its first
    push), gives the rows of one never interrupted, evaluation figures included."""
    common = ("rollout.prompts_per_step=4", "learner.micro_batch_size=16", "run.checkpoint_every=2",
              "cluster.colocate=hybrid", "eval.every=2")
    train(quickstart(tmp_path / "whole", *common, "run.steps=4"))
    train(quickstart(tmp_path / "cut", *common, "run.steps=3", "run.checkpoint_at_end=false"))
    train(quickstart(tmp_path / "cut", *common, "run.steps=4", "run.resume=true", "run.overwrite=false"))
    whole, resumed = (outcome(tmp_path / name / "quickstart" / "metrics.jsonl") for name in ("whole", "cut"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["step"] for r in whole if "eval/toy-heldout/accuracy" in r] == [2, 4]
    assert resumed == whole


def test_a_hybrid_actor_killed_mid_run_is_a_learner_death_recovered_from_a_checkpoint(ray_session, tmp_path):
    proc, metrics = start_quickstart(tmp_path, "run.steps=6", "run.checkpoint_every=2", "cluster.colocate=hybrid",
                                     cluster=ray_session)
    wait_for_checkpoint(proc, metrics.parent / "checkpoints" / "step_000002" / "manifest.json")
    kill_actor(os.getpid(), "HybridWorker")
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "hybrid-0 died in step" in out and "restarting every role from" in out, out[-3000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
