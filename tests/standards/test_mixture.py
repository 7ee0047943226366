"""Several environments in one run: rows interleaved from their sources, each episode in its own environment, the
figures kept apart by environment; and the preflight's refusal of a standard whose package is missing."""

from __future__ import annotations

import pytest

from distrl import standards
from distrl.standards import mixture
from tests.standards.scripted import play


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from distrl.config import ModelConfig
    from distrl.workers.model_files import load_tokenizer

    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


def test_rows_interleave_the_sources_each_row_tagged_with_its_own():
    rows = mixture.rows({"a": {"function": "distrl.standards:seeds", "kwargs": {"count": 3}},
                         "b": {"function": "distrl.standards:seeds", "kwargs": {"count": 1, "first": 10}}})
    assert [(r["env"], r["seed"]) for r in rows] == [("a", 0), ("b", 10), ("a", 1), ("a", 2)]
    with pytest.raises(ValueError, match="source 'a' must be"):
        mixture.rows({"a": {"fn": "distrl.standards:seeds"}})


def test_each_episode_plays_in_the_environment_its_row_names(tokenizer):
    envs = {"calc": {"class": "distrl.agents.envs:ToolEnvironment",
                     "kwargs": {"tools": [], "reward": "distrl.workers.rewards:exact_match"}},
            "echo": {"class": "tests.agent_envs:Chatter", "kwargs": {"turns": 2}}}
    rows = [{"prompt": "1 + 1?", "answer": "2", "env": "calc"}, {"prompt": "talk", "env": "echo"}]
    calc, echo = play(tokenizer, "distrl.standards.mixture:Mixture", {"envs": envs}, rows, ["2", "x 1"],
                      tool_parser=None)
    assert (calc.episode.turns, calc.episode.reward, calc.episode.metrics) == (1, 1.0, {"calc/reward": 1.0})
    assert (echo.episode.turns, echo.episode.reward, echo.episode.metrics) == (2, 1.0, {"echo/reward": 1.0})


def test_a_row_of_no_environment_of_the_mixture_fails_its_episode(tokenizer):
    from distrl.agents.host import EnvError

    envs = {"echo": {"class": "tests.agent_envs:Chatter"}}
    with pytest.raises(EnvError, match=r"the row's 'env' is 'other', not one of the mixture's environments"):
        play(tokenizer, "distrl.standards.mixture:Mixture", {"envs": envs}, [{"prompt": "?", "env": "other"}],
             ["x"], tool_parser=None)


def test_a_config_naming_a_standard_whose_package_is_missing_is_refused_with_the_pip_line(monkeypatch, tmp_path,
                                                                                          tiny_model_dir):
    from distrl import preflight
    from distrl.config import from_dict

    monkeypatch.setitem(standards.STANDARDS, "verifiers", standards.Standard("distrl_no_such_package", "verifiers"))
    cfg = from_dict({
        "model": {"path": str(tiny_model_dir)},
        "data": {"function": "distrl.standards.verifiers:rows", "kwargs": {"env_id": "my-env"}},
        "env": {"class": "distrl.standards.mixture:Mixture",
                "kwargs": {"envs": {"a": {"class": "distrl.standards.verifiers:VerifiersEnv",
                                          "kwargs": {"env_id": "my-env"}}}}},
        "run": {"output_dir": str(tmp_path)}, "cluster": {"backend": "local"}})
    with pytest.raises(preflight.PreflightError) as err:
        preflight.check(cfg)
    pip = "needs the distrl_no_such_package package, which is not installed: pip install 'distrl[verifiers]'"
    assert err.value.problems == [f"data.function: distrl.standards.verifiers:rows {pip}",
                                  f"env.kwargs.envs.a.class: distrl.standards.verifiers:VerifiersEnv {pip}"]
    with pytest.raises(standards.StandardMissing, match=r"pip install 'distrl\[verifiers\]'"):
        standards.require("verifiers")
