"""Gym-style text environments through distrl's episode runner: gem's Guess The Number (multi-turn, its own hints
and rewards) and skyrl-gym's multi-turn GSM8k (turn-level rewards, SkyRL's row layout), observations appended as
chat messages, the model's turns as the actions."""

from __future__ import annotations

import pytest

from distrl.standards import numeric, seeds
from tests.standards.scripted import play

GEM, SKYRL = "distrl.standards.gem:GemEnv", "distrl.standards.skyrl_gym:SkyRLGymEnv"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from distrl.config import ModelConfig
    from distrl.workers.model_files import load_tokenizer

    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


def gem_target(seed: int) -> int:
    """The number gem's game draws for `seed` (what reset(seed) draws, replayed)."""
    import gem

    env = gem.make("game:GuessTheNumber-v0-easy")
    env.reset(seed=seed)
    return env.game_number


def test_a_gem_game_is_played_turn_by_turn_with_its_own_hints_and_rewards(tokenizer):
    pytest.importorskip("gem")
    rows = seeds(4)
    targets = [gem_target(r["seed"]) for r in rows]
    results = play(tokenizer, GEM, {"env_id": "game:GuessTheNumber-v0-easy"}, rows,
                   [r"\boxed{5}", r"\boxed{3}", r"\boxed{7}", r"\boxed{1}"], tool_parser=None)
    for target, result in zip(targets, results, strict=True):
        e = result.episode
        guesses = [5, 3, 7, 1]
        turns = guesses.index(target) + 1 if target in guesses else 4  # the easy game allows 4 guesses
        assert (e.turns, e.cut, e.drift) == (turns, None, 0)
        assert e.reward == (1.0 if target in guesses else pytest.approx(1 - abs(1 - target) / 9))
        first = tokenizer.decode(result.trajectory.prompt_ids)
        assert "You are playing Guess The Number" in first
        if turns > 1:  # the hint after the first guess is an observation: given, not trained on
            assert "you guessed 5, and the target number is" in tokenizer.decode(result.trajectory.response_ids)
            assert 0 in result.trajectory.mask


def test_a_hung_gem_step_ends_its_episode_and_later_episodes_run_on_another_thread(tokenizer):
    pytest.importorskip("gem")
    from distrl.standards.gem import _GEM
    from tests.standards import gem_hang

    kwargs = {"env_id": gem_hang.ENV_ID}
    gem_hang.CLOSED.clear()
    try:
        [hung] = play(tokenizer, GEM, kwargs, seeds(1), [gem_hang.HANG], tool_parser=None, timeout_s=1.0)
        assert (hung.episode.cut, hung.episode.turns) == ("env_timeout", 1)
        # The step still hangs (until RELEASE); on a single gem thread these would wait behind it and be cut too.
        later = play(tokenizer, GEM, kwargs, seeds(3, first=1), ["fine"], tool_parser=None, timeout_s=20.0)
        assert [(r.episode.cut, r.episode.reward, r.episode.metrics) for r in later] == \
            [(None, 1.0, {"seed": float(seed)}) for seed in (1, 2, 3)]
        _GEM.submit(lambda: None)[1].result(20)  # the gem thread runs calls in order: the closes before it ran
        assert sorted(gem_hang.CLOSED) == [0, 1, 2, 3]  # the hung episode's environment is closed too
    finally:
        gem_hang.RELEASE.set()


def test_calls_waiting_behind_a_hung_gem_call_move_to_the_new_thread():
    pytest.importorskip("gem")
    import threading

    from distrl.standards.gem import _GemThread

    gem_thread, release = _GemThread(), threading.Event()
    stuck, hung = gem_thread.submit(lambda: release.wait(60))
    _, waiting = gem_thread.submit(lambda: "ran")
    while not hung.running():
        release.wait(0.01)
    gem_thread.abandon(stuck)
    assert waiting.result(20) == "ran" and not hung.done()
    assert gem_thread.worker is not stuck and gem_thread.submit(lambda: 7)[1].result(20) == 7
    release.set()
    assert hung.result(20) is True


def test_a_skyrl_gym_environment_gives_turn_level_rewards_and_its_metrics(tokenizer):
    pytest.importorskip("skyrl_gym")
    row = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "env_class": "gsm8k_multi_turn",
           "reward_spec": {"method": "rule", "ground_truth": "4"}, "extra_info": {}, "max_turns": 3}
    [wrong_then_right] = play(tokenizer, SKYRL, {}, [row], ["#### 3", "#### 4"], tool_parser=None)
    e = wrong_then_right.episode
    # Turn 1: well formatted but wrong, 0.2 / 3; turn 2: right, 1.0 and done.
    assert (e.turns, e.cut, e.drift) == (2, None, 0)
    assert e.reward == pytest.approx(0.2 / 3 + 1.0) and e.metrics == {"steps": 2.0}
    assert "#### ANSWER" in tokenizer.decode(wrong_then_right.trajectory.response_ids)
    [never] = play(tokenizer, SKYRL, {"env_class": "gsm8k_multi_turn"}, [{**row, "env_class": None}], ["no"],
                   tool_parser=None)
    assert (never.episode.turns, never.episode.reward) == (3, 0.0)


def test_seeds_are_rows_of_episodes():
    assert seeds(2, first=5) == [{"prompt": "episode 5", "seed": 5}, {"prompt": "episode 6", "seed": 6}]
    with pytest.raises(ValueError, match="at least 1"):
        seeds(0)


def test_numeric_keeps_an_environments_numbers_as_figures():
    info = {"turns": 3, "score": 0.5, "solved": True, "guess": "7", "trace": [1, 2], "none": None}
    assert numeric(info) == {"turns": 3.0, "score": 0.5}  # booleans are flags, not figures
