"""In-job recovery with real Ray and vLLM, each fault injected with SIGKILL into a running quickstart:

- a rollout actor is replaced on its placement bundle, served the current weights and given back the prompts it
  held; the run completes its planned steps with every batch full and no prompt lost;
- a learner is recovered from the newest checkpoint (every role started again); the run completes with one row
  per step.

Each test injects its faults one after the other into a single run: starting the quickstart costs more than all
its steps.
"""

import json

from .conftest import start_quickstart
from .faults import finish, kill_actor, rows_of, wait_for_checkpoint

STEPS = 8


def test_a_rollout_actor_and_then_a_learner_killed_mid_run_are_recovered(tmp_path):
    """Both faults in one run (each start of the quickstart costs more than its steps): the rollout actor first,
    replaced in the running job; then, once step 4's checkpoint is written, the learner, recovered from it."""
    proc, metrics = start_quickstart(tmp_path, f"run.steps={STEPS}", "run.checkpoint_every=2")
    # Step 2 is logged after its weights were pushed and step 3's chunk was sent: the engine is most likely
    # generating (if it finished already, its death is noticed at the next push instead; either way it is replaced).
    kill_actor(proc.pid, "RolloutWorker")
    wait_for_checkpoint(proc, metrics.parent / "checkpoints" / "step_000004" / "manifest.json", within_s=180)
    kill_actor(proc.pid, "Learner")  # in step 5 or later: the newest checkpoint is step 4's
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout actor rollout-0 died (ActorDiedError); starting a replacement" in out, out[-3000:]
    assert "rollout actor rollout-0 (replacement 1) serves policy version" in out
    assert "learner-0 died in step" in out and "restarting every role from" in out, out[-3000:]
    rows = rows_of(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # the steps after the checkpoint, redone once
    assert sum(r["faults/rollout_restarts"] for r in rows) == 1
    assert sum(r["faults/recoveries"] for r in rows) == 1
    # Every step trained a full batch, and the prompts the dead engine held were sent again: after the planned
    # steps of 8 prompts, tickets 0..8 x STEPS - 1 are consumed and nothing beyond.
    state = json.loads((metrics.parent / "checkpoints" / f"step_{STEPS:06d}" / "driver_state.json").read_text())
    assert state["data"]["next"] == 8 * STEPS and state["data"]["consumed"] == []
    assert all(r["learner/tokens"] > 0 for r in rows)
