"""PPO with a critic on real Ray and vLLM: `distrl train --config configs/ppo-gae.yaml`, small and short, then
resumed from its checkpoint, which holds the critic part. Critic actors run in their own placement group and
process group beside the learners."""

import json
import math
import subprocess
import sys

from .conftest import ROOT, cli_env

SMALL = ("rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.sampling.max_new_tokens=8",
         "learner.micro_batch_size=16", "run.checkpoint_every=2", "run.progress=false", "critic.ppo_epochs=2",
         "critic.mini_batch_size=8", "critic.micro_batch_size=8")


def run(tmp_path, *overrides: str) -> subprocess.CompletedProcess:
    settings = [f"run.output_dir={tmp_path}", f"model.path={tmp_path / 'tiny-model'}", *SMALL, *overrides]
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/ppo-gae.yaml",
           *(arg for setting in settings for arg in ("--set", setting))]
    return subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=900, check=False)


def test_ppo_with_a_critic_runs_and_resumes_from_a_checkpoint_with_the_critic_part(tmp_path):
    first = run(tmp_path, "run.steps=2")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    checkpoint = tmp_path / "ppo-gae" / "checkpoints" / "step_000002"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["parts"] == ["policy", "critic"]
    assert any(name.startswith("critic/model/") for name in manifest["files"])

    resumed = run(tmp_path, "run.steps=3", "run.resume=true", "run.overwrite=false")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-5000:]
    assert f"resumed from {checkpoint}" in resumed.stdout
    rows = [json.loads(line) for line in (tmp_path / "ppo-gae" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Two epochs of two critic mini-batches a step, counted on from the checkpoint's optimizer state.
    assert [r["critic/optimizer_steps"] for r in rows] == [4, 8, 12]
    for r in rows:
        for key in ("critic/value_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean",
                    "critic/grad_norm", "critic/lr", "time/values"):
            assert math.isfinite(r[key]), (key, r)
