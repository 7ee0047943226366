"""PPO with a critic (GAE) through the driver on the local backend: the quickstart task is learned, the critic's
figures are logged, both loops run, and checkpoints carry the critic part that a resume loads."""

import json
import math
from pathlib import Path

from distrl import checkpoint, config
from distrl.driver import train
from tests.hf_rollout import HFRolloutWorker

ROOT = Path(__file__).resolve().parents[1]
CRITIC_FIGURES = ("critic/value_loss", "critic/vf_clipfrac", "critic/explained_variance", "critic/values_mean",
                  "critic/grad_norm", "critic/lr", "critic/returns_mean")


def gae_config(tmp_path: Path, model_dir: Path, *overrides: str) -> config.Config:
    return config.load(ROOT / "configs" / "ppo-gae.yaml", [
        f"model.path={model_dir}", f"run.output_dir={tmp_path}", "run.progress=false", "run.ray_metrics=false",
        "run.tensorboard=false", "cluster.backend=local", *overrides])


def test_ppo_with_gae_learns_the_quickstart_task(tmp_path, tiny_model_dir):
    # 10 steps of 8 prompts x 4 samples of up to 8 tokens: measured 0.301 -> 0.358 (first 3 -> last 3 steps).
    cfg = gae_config(tmp_path, tiny_model_dir, "run.steps=10", "rollout.n_samples_per_prompt=4",
                     "rollout.sampling.max_new_tokens=8")
    history = train(cfg, rollout_worker=HFRolloutWorker)
    rewards = [h["reward/mean"] for h in history]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.03, rewards
    assert [h["critic/optimizer_steps"] for h in history] == list(range(1, 11))
    for h in history:
        assert all(math.isfinite(h[k]) for k in CRITIC_FIGURES), h
        assert h["critic/skipped_steps"] == 0
    # The critic learns the returns: its loss falls from the fresh head's.
    assert history[-1]["critic/value_loss"] < history[0]["critic/value_loss"]
    final = checkpoint.latest(Path(cfg.run.output_dir) / cfg.run.name)
    assert final is not None and checkpoint.problem(final) is None
    assert json.loads((final / "manifest.json").read_text())["parts"] == ["policy", "critic"]


SMALL = ("rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4", "rollout.sampling.max_new_tokens=6",
         "learner.micro_batch_size=16", "critic.ppo_epochs=2", "critic.mini_batch_size=8", "critic.micro_batch_size=8")


def test_async_ppo_with_gae_trains_the_critic_beside_the_policy(tmp_path, tiny_model_dir):
    cfg = gae_config(tmp_path, tiny_model_dir, *SMALL, "loop.mode=async", "loop.max_staleness=1", "run.steps=3")
    history = train(cfg, rollout_worker=HFRolloutWorker)
    assert max(h["staleness/max"] for h in history) == 1
    # Two epochs of two mini-batches: 4 critic optimizer steps a training step; the policy takes one.
    assert [h["critic/optimizer_steps"] for h in history] == [4, 8, 12]
    assert [h["learner/optimizer_steps"] for h in history] == [1, 2, 3]
    # After the first mini-batch step the values have moved: some tokens hit the clip range over the epochs.
    assert all(0 <= h["critic/vf_clipfrac"] <= 1 for h in history)
    assert all(math.isfinite(h[k]) for h in history for k in CRITIC_FIGURES)


def test_a_resumed_run_continues_with_its_critic(tmp_path, tiny_model_dir):
    common = (*SMALL, "run.checkpoint_every=2", "data.shuffle=false")
    whole = train(gae_config(tmp_path / "full", tiny_model_dir, *common, "run.steps=3"),
                  rollout_worker=HFRolloutWorker)
    train(gae_config(tmp_path / "cut", tiny_model_dir, *common, "run.steps=2"), rollout_worker=HFRolloutWorker)
    resumed = train(gae_config(tmp_path / "cut", tiny_model_dir, *common, "run.steps=3", "run.resume=true",
                               "run.overwrite=false"), rollout_worker=HFRolloutWorker)
    assert len(resumed) == 1 and resumed[0]["policy_version"] == whole[-1]["policy_version"] == 2
    assert resumed[0]["critic/optimizer_steps"] == whole[-1]["critic/optimizer_steps"] == 12
    # The resumed critic is the uninterrupted one (weights and Adam state): the same values and the same update.
    for key in ("critic/explained_variance", "critic/returns_mean", "critic/value_loss", "critic/grad_norm"):
        assert abs(resumed[0][key] - whole[-1][key]) < 1e-4, (key, resumed[0][key], whole[-1][key])


def test_episodes_of_several_sequences_train_the_critic_with_its_configured_steps(tmp_path, tiny_model_dir):
    """Batches of more than 16 rows (half the episodes are two sequences, each with the episode's reward on its
    last token): the critic still takes 2 epochs x 16 / 8 mini-batches a step, and its figures are finite."""
    from tests.segmented_rollout import SegmentedRolloutWorker

    SegmentedRolloutWorker.episodes_split = 0
    history = train(gae_config(tmp_path, tiny_model_dir, *SMALL, "run.steps=2"),
                    rollout_worker=SegmentedRolloutWorker)
    assert SegmentedRolloutWorker.episodes_split > 0
    assert [h["critic/optimizer_steps"] for h in history] == [4, 8]
    assert [h["learner/optimizer_steps"] for h in history] == [1, 2]
    assert all(math.isfinite(h[k]) for h in history for k in CRITIC_FIGURES)
