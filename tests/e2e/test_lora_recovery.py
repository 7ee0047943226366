"""In-job recovery of a LoRA run (the quickstart with `learner.lora`), each fault injected with SIGKILL into one run
(starting it costs more than all its steps): a replacement engine starts serving the current adapters (pushed to it
alone and verified against its LoRA slot), and a dead learner is recovered from the newest checkpoint's adapters
and optimizer state."""

import os

from .conftest import start_quickstart
from .faults import finish, kill_actor, rows_of, wait_for_checkpoint

STEPS = 8

LORA = ("learner.lora.rank=8", "learner.lora.alpha=16", "learner.lr=1e-2")


def test_a_replacement_engine_serves_the_current_adapters_and_a_dead_learner_resumes_its_checkpoint(ray_session,
                                                                                                    tmp_path):
    proc, metrics = start_quickstart(tmp_path, f"run.steps={STEPS}", "run.checkpoint_every=2", *LORA,
                                     cluster=ray_session)
    kill_actor(os.getpid(), "RolloutWorker")
    adapters = metrics.parent / "checkpoints" / "step_000004" / "manifest.json"
    wait_for_checkpoint(proc, adapters, within_s=180)
    assert (adapters.parent / "policy" / "adapter" / "adapter_model.safetensors").is_file()
    kill_actor(os.getpid(), "Learner")  # in step 5 or later: the newest checkpoint is step 4's
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout actor rollout-0 (replacement 1) serves policy version" in out, out[-3000:]
    assert "learner-0 died in step" in out and "restarting every role from" in out, out[-3000:]
    rows = rows_of(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert sum(r["faults/rollout_restarts"] for r in rows) == 1
    assert sum(r["faults/recoveries"] for r in rows) == 1
    # The replacement, and the engine started again with every role, sample with the learner's adapters (verified
    # pushes; fp32 both sides: no mismatch).
    assert all(abs(r["correction/mismatch_kl/staleness_0"]) < 1e-4 for r in rows)
