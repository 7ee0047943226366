"""SIGTERM and Ctrl-C stop a run cleanly (local backend, in a child process, since signals go to a whole process):
the first signal finishes the step in progress, checkpoints it and says how to resume; a second stops at once; the
run directory holds a row for every finished step and nothing else."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distrl import checkpoint

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys
from distrl import config
from distrl.driver import train
from distrl.stop import Stopped
from tests.hf_rollout import HFRolloutWorker

cfg = config.load("configs/quickstart.yaml", sys.argv[1:])
try:
    train(cfg, rollout_worker=HFRolloutWorker)
except Stopped as stopped:
    print(stopped, file=sys.stderr)
    sys.exit(stopped.exit_code)
"""


def start(tmp_path: Path, model_dir: Path, *overrides: str) -> subprocess.Popen:
    args = [f"model.path={model_dir}", f"run.output_dir={tmp_path}", "run.progress=false", "run.ray_metrics=false",
            "run.tensorboard=false", "cluster.backend=local", "rollout.prompts_per_step=2",
            "rollout.n_samples_per_prompt=4", "rollout.sampling.max_new_tokens=4", "learner.micro_batch_size=8",
            "run.steps=100000", *overrides]
    return subprocess.Popen([sys.executable, "-c", SCRIPT, *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})


def rows(tmp_path: Path) -> list[dict]:
    path = tmp_path / "quickstart" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_rows(proc: subprocess.Popen, tmp_path: Path, n: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(rows(tmp_path)) < n:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the run logged {len(rows(tmp_path))} rows; stderr:\n{proc.communicate()[1]}")
        time.sleep(0.1)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_finishes_the_step_checkpoints_it_and_says_how_to_resume(tmp_path, tiny_model_dir, sig):
    proc = start(tmp_path, tiny_model_dir, "loop.mode=async", "loop.max_staleness=1")
    wait_for_rows(proc, tmp_path, 2)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    last = rows(tmp_path)[-1]["step"]
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, last + 1))
    assert f"stopped by {sig.name} after step {last} of 100000" in err
    assert f"holds a checkpoint of step {last}: continue with --set run.resume=true" in err
    found = checkpoint.latest(tmp_path / "quickstart")
    assert found is not None and found.name == f"step_{last:06d}" and checkpoint.problem(found) is None


def test_a_second_signal_stops_at_once_and_leaves_only_finished_steps(tmp_path, tiny_model_dir):
    # Each step scores 8 samples at 0.25 s: both signals come while a step is still running.
    proc = start(tmp_path, tiny_model_dir, "run.checkpoint_every=1", "reward.function=tests.slow_rewards:slow_toy")
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    wait_for_rows(proc, tmp_path, 2)
    time.sleep(0.5)  # into the next step
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 30
    while not any("stopping after the step in progress" in line for line in lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode != 0 and "StopNow: SIGINT received twice: stopping at once" in err, err
    steps = [r["step"] for r in rows(tmp_path)]
    assert steps == list(range(1, steps[-1] + 1))
    # An interrupted save leaves at most a .tmp directory, which resume ignores: the newest checkpoint is complete.
    found = checkpoint.latest(tmp_path / "quickstart")
    assert found is not None and checkpoint.problem(found) is None
    assert checkpoint.driver_state(found)["step"] <= steps[-1]


def test_a_signal_during_start_up_stops_before_any_step_and_leaves_nothing(tmp_path, tiny_model_dir):
    proc = start(tmp_path, tiny_model_dir)
    config_yaml = tmp_path / "quickstart" / "config.yaml"  # written once the run directory is claimed
    assert wait_until_exists(config_yaml, proc), proc.communicate()[1]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "stopped by SIGTERM during the" in err and "before any step of this run" in err
    assert not (tmp_path / "quickstart").exists()  # a run that logged no step leaves no run directory


def wait_until_exists(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True
