"""The reward-collapse watch (`distrl.reward_watch`, `run.reward_collapse`): hand-worked figures, the warning once
per fall, and a run on the local backend that says so in its log and rows."""

import itertools

import pytest

from distrl.config.collapse import RewardCollapseConfig
from distrl.driver import train
from distrl.reward_watch import RewardWatch
from tests import collapsing_rewards
from tests.hf_rollout import HFRolloutWorker
from tests.test_driver_local import local_config, rows


def watched(rewards: list[float], **cfg) -> list[tuple[float | None, float, bool]]:
    watch = RewardWatch(RewardCollapseConfig(**cfg))
    out = []
    for reward in rewards:
        figures, warning = watch.observe(reward)
        out.append((figures["health/reward_vs_best"], figures["health/reward_collapsed"], warning is not None))
    return out


def test_the_smoothed_reward_against_its_best_by_hand():
    # window 2: means 0.6 (best), 0.8 (best), 0.5 (0.625), 0.2 (0.25 <= 0.5: 1 step), 0.1 (0.125: 2 steps, warned)
    got = watched([0.4, 0.8, 0.8, 0.2, 0.2, 0.0], fraction=0.5, window=2, steps=2)
    assert got[0] == (None, 0.0, False)  # no full window yet
    assert [g[0] for g in got[1:]] == pytest.approx([1.0, 1.0, 0.625, 0.25, 0.125])
    assert [g[1] for g in got] == [0, 0, 0, 0, 0, 1]
    assert [g[2] for g in got] == [False] * 5 + [True]


def test_the_warning_comes_once_per_fall_and_again_after_a_recovery():
    # window 1, steps 1: 1.0 best; 0.4 collapsed (warned); 0.3 still (not warned again); 0.9 recovered; 0.1 again
    got = watched([1.0, 0.4, 0.3, 0.9, 0.1], fraction=0.5, window=1, steps=1)
    assert [g[1] for g in got] == [0, 1, 1, 0, 1]
    assert [g[2] for g in got] == [False, True, False, False, True]
    assert got[3][0] == pytest.approx(0.9)


def test_a_reward_never_above_zero_is_not_watched():
    got = watched([-1.0, -0.5, -2.0, -3.0, 0.0], fraction=0.5, window=1, steps=1)
    assert got == [(None, 0.0, False)] * 5


def test_a_watch_rebuilt_from_logged_rewards_continues_as_the_one_that_saw_them():
    cfg = RewardCollapseConfig(fraction=0.5, window=2, steps=3)
    rewards = [0.5, 0.7, 0.2, 0.1, 0.1, 0.0, 0.6]
    whole = RewardWatch(cfg)
    expected = [whole.observe(r) for r in rewards][4:]
    rebuilt = RewardWatch(cfg, rewards[:4])
    assert [rebuilt.observe(r) for r in rewards[4:]] == expected
    assert expected[1][1] is not None  # the warning falls after the rebuild, and the rebuilt watch gives it too


def test_a_run_whose_reward_collapses_says_so_in_its_log_and_rows(tmp_path, tiny_model_dir, capsys):
    """Rewards of 1 for three steps of 16 samples, then 0: with a window of 1 and 2 steps below half the best, step 5
    finds the run collapsed and the log says so once; the run goes on."""
    collapsing_rewards.counter = itertools.count(1)
    cfg = local_config(tmp_path, tiny_model_dir, "run.steps=6", "reward.function=tests.collapsing_rewards:"
                       "first_high_then_zero", "run.reward_collapse={window: 1, steps: 2}")
    train(cfg, rollout_worker=HFRolloutWorker)
    logged = rows(cfg)
    assert [r["reward/mean"] for r in logged] == [1, 1, 1, 0, 0, 0]
    assert [r["health/reward_vs_best"] for r in logged] == [1, 1, 1, 0, 0, 0]
    assert [r["health/reward_collapsed"] for r in logged] == [0, 0, 0, 0, 1, 1]
    out = capsys.readouterr().out
    assert out.count("warning: step 5: the mean reward collapsed: 0.000 over the last 1 steps is 0% of the best, "
                     "1.000, and has been at most 50% of it for 2 steps") == 1
    assert "warning: step 6" not in out


def test_no_watch_when_it_is_turned_off(tmp_path, tiny_model_dir):
    cfg = local_config(tmp_path, tiny_model_dir, "run.steps=1", "run.reward_collapse=null")
    train(cfg, rollout_worker=HFRolloutWorker)
    assert "health/reward_collapsed" not in rows(cfg)[0]
