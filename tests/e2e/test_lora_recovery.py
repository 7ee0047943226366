"""In-job recovery of a LoRA run (the quickstart with `learner.lora`), each fault injected with SIGKILL: a replacement
engine starts serving the current adapters (pushed to it alone and verified against its LoRA slot), and a dead
learner is recovered from the newest checkpoint's adapters and optimizer state."""

import time

import pytest

from .conftest import start_quickstart
from .test_recovery import STEPS, finish, kill_actor, rows_of

LORA = ("learner.lora.rank=8", "learner.lora.alpha=16", "learner.lr=1e-2")


def test_a_replacement_engine_serves_the_current_adapters(tmp_path):
    proc, metrics = start_quickstart(tmp_path, f"run.steps={STEPS}", *LORA)
    kill_actor(proc.pid, "RolloutWorker")
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "rollout actor rollout-0 (replacement 1) serves policy version" in out, out[-3000:]
    rows = rows_of(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert sum(r["faults/rollout_restarts"] for r in rows) == 1
    # The replacement samples with the learner's adapters (verified push; fp32 both sides: no mismatch).
    assert all(abs(r["correction/mismatch_kl/staleness_0"]) < 1e-4 for r in rows)


def test_a_dead_lora_learner_is_recovered_from_the_checkpoint(tmp_path):
    proc, metrics = start_quickstart(tmp_path, f"run.steps={STEPS}", "run.checkpoint_every=2", *LORA)
    adapters = metrics.parent / "checkpoints" / "step_000002" / "manifest.json"
    deadline = time.monotonic() + 60
    while not adapters.exists():
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no checkpoint of step 2 within 60 s:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.1)
    assert (adapters.parent / "policy" / "adapter" / "adapter_model.safetensors").is_file()
    kill_actor(proc.pid, "Learner")
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    assert "learner-0 died in step" in out and "restarting every role from" in out, out[-3000:]
    rows = rows_of(metrics)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert sum(r["faults/recoveries"] for r in rows) == 1
    assert all(abs(r["correction/mismatch_kl/staleness_0"]) < 1e-4 for r in rows)
