"""The README's main job, as a user runs it: `distrl train --config configs/quickstart.yaml` in a fresh process
with its own embedded Ray cluster. The tiny model must measurably learn the toy task, and the run must write the
promised metrics, TensorBoard files and summary."""

import json
import subprocess
import sys

from .conftest import ROOT, cli_env

REQUIRED_KEYS = {"step", "policy_version", "reward/mean", "response_length/mean", "loss/policy", "kl/ref",
                 "correction/mismatch_kl", "correction/weight_mean", "clip/frac", "time/generate",
                 "time/reference", "time/update", "time/sync", "time/step", "throughput/tokens_per_s",
                 # beyond the list: the rest of the step's phases
                 "time/old_logprobs", "time/advantages", "time/driver_overhead", "staleness/max",
                 "idle/rollout", "buffer/depth"}


def test_quickstart_learns(tmp_path):
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           "--set", f"run.output_dir={tmp_path}", "--set", f"model.path={tmp_path / 'tiny-model'}"]
    result = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=900,
                            check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert "mean reward, first" in result.stdout and "metrics.jsonl" in result.stdout
    assert "held-out toy-heldout: accuracy " in result.stdout
    # The console carries distrl's lines and the progress bar; vLLM's, Ray's and torch's go to the library log.
    library_log = tmp_path / "quickstart" / "libraries.log"
    console = result.stdout + result.stderr
    assert f"libraries' output inside the actors: {library_log}" in result.stdout
    for chatter in ("WARNING", "Warning", "LD_PRELOAD", "chunked prefill", "Loading safetensors", "autoscaler",
                    "Started a local Ray instance", "Token authentication"):
        assert chatter not in console, f"{chatter!r} on the console:\n{console[-5000:]}"
    assert "LD_PRELOAD" in library_log.read_text() and "(RolloutWorker pid=" in library_log.read_text()

    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and rows[0].keys() >= REQUIRED_KEYS
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first + 0.15, f"did not learn: first 5 steps {first:.3f}, last 5 steps {last:.3f}"
    # fp32 rollout and learner: TIS sees only the kernels' rounding (the bf16 mismatch is checked in test_service).
    assert all(abs(r["correction/mismatch_kl"]) < 1e-6 for r in rows)
    assert all(abs(r["correction/weight_mean"] - 1.0) < 1e-3 for r in rows)
    assert any((tmp_path / "quickstart" / "tensorboard").iterdir())
    # The held-out set, greedy after steps 10, 20 and 30: the policy improves on prompts it never trained on.
    held = [r["eval/toy-heldout/accuracy"] for r in rows if "eval/toy-heldout/accuracy" in r]
    assert [r["step"] for r in rows if "eval/toy-heldout/accuracy" in r] == [10, 20, 30]
    assert held[-1] > held[0], f"held-out accuracy did not rise: {held}"
    assert (tmp_path / "quickstart" / "eval" / "toy-heldout" / "step_000030.jsonl").is_file()
