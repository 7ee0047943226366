"""PPO with a critic on real Ray and vLLM: configs/ppo-gae.yaml, small and short, then resumed from its checkpoint,
which holds the critic part. Critic actors run in their own placement group and process group beside the
learners."""

import json
import math

from distrl import config
from distrl.driver import train

from .conftest import ROOT

SMALL = ("rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.sampling.max_new_tokens=8",
         "learner.micro_batch_size=16", "run.checkpoint_every=2", "run.progress=false", "critic.ppo_epochs=2",
         "critic.mini_batch_size=8", "critic.micro_batch_size=8")


def ppo_gae(tmp_path, *overrides: str) -> config.Config:
    return config.load(ROOT / "configs" / "ppo-gae.yaml", [f"run.output_dir={tmp_path}",
                                                           f"model.path={tmp_path / 'tiny-model'}", *SMALL, *overrides])


def test_ppo_with_a_critic_runs_and_resumes_from_a_checkpoint_with_the_critic_part(ray_session, tmp_path, capsys):
    train(ppo_gae(tmp_path, "run.steps=2"))
    checkpoint = tmp_path / "ppo-gae" / "checkpoints" / "step_000002"
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["parts"] == ["policy", "critic"]
    assert any(name.startswith("critic/model/") for name in manifest["files"])

    train(ppo_gae(tmp_path, "run.steps=3", "run.resume=true", "run.overwrite=false"))
    assert f"resumed from {checkpoint}" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "ppo-gae" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Two epochs of two critic mini-batches a step, counted on from the checkpoint's optimizer state.
    assert [r["critic/optimizer_steps"] for r in rows] == [4, 8, 12]
    for r in rows:
        for key in ("critic/value_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean",
                    "critic/grad_norm", "critic/lr", "time/values"):
            assert math.isfinite(r[key]), (key, r)
