"""OpenEnv environments through distrl's episode runner: a server the test starts on 127.0.0.1 (uvicorn, OpenEnv's
`create_app`) shared by many episodes at once, each in a WebSocket session of its own through the environment's own
client; a server distrl starts itself; and a server that dies or hangs ending its episodes under `env.on_error` and
`env.step_timeout_s`."""

from __future__ import annotations

import signal
import time

import pytest

from distrl.agents.host import EnvError
from distrl.standards import openenv as adapter
from distrl.standards import seeds
from tests.standards.openenv_words import SLOW_WORD, WORDS
from tests.standards.scripted import play

pytest.importorskip("openenv")

APP = "tests.standards.openenv_words:app"
SPEC = "distrl.standards.openenv:OpenEnv"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from distrl.config import ModelConfig
    from distrl.workers.model import load_tokenizer

    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def server():
    """The module's server, on 127.0.0.1: the one distrl serves `APP` with (`adapter.server`), started once and
    shared by the tests; (its URL, its process). The last tests kill it."""
    import asyncio

    served = adapter.server(APP)
    asyncio.run(served.ready(120))
    yield served.url, served.proc
    adapter.server(APP).stop()


def test_many_episodes_share_one_server_each_in_its_own_session(tokenizer, server):
    url, _ = server
    rows = seeds(6)
    kwargs = {"url": url, "client": "tests.standards.openenv_words:WordEnv",
              "action": "tests.standards.openenv_words:WordAction", "observation_field": "prompt",
              "system_prompt": "Play."}
    results = play(tokenizer, SPEC, kwargs, rows, ["apple", "river"], tool_parser=None)
    for row, result in zip(rows, results, strict=True):
        e = result.episode
        word = WORDS[row["seed"]]
        # Two steps: each rewards 1 if the turn said the row's word (the reset's seed picks it).
        assert (e.turns, e.cut, e.drift) == (2, None, 0)
        assert e.reward == (word == "apple") + (word == "river")
        assert e.metrics == {"length": 5.0}  # the observation's metadata of the last step
    assert [r.episode.reward for r in results] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_the_generic_client_shows_the_observation_as_json(tokenizer, server):
    url, _ = server
    [result] = play(tokenizer, SPEC, {"url": url}, seeds(1, first=1), ["river", "river"], tool_parser=None)
    assert result.episode.reward == 2.0
    text = tokenizer.decode(result.trajectory.prompt_ids)
    assert '{"prompt": "Say the word river.", "said": ""}' in text


def test_a_server_that_hangs_ends_the_episode_at_the_step_time_limit(tokenizer, server):
    url, _ = server
    began = time.monotonic()
    [result] = play(tokenizer, SPEC, {"url": url}, seeds(1), [SLOW_WORD], tool_parser=None, timeout_s=1.0)
    assert (result.episode.cut, result.episode.turns) == ("env_timeout", 1)
    assert time.monotonic() - began < 30


def test_a_server_distrl_starts_serves_the_run_and_is_started_again_if_it_died(tokenizer, server):
    kwargs = {"app": APP, "observation_field": "prompt", "sessions": 2}
    first = play(tokenizer, SPEC, kwargs, seeds(3), ["apple"], tool_parser=None)
    assert [r.episode.reward for r in first] == [2.0, 0.0, 0.0]
    served = adapter.server(APP)
    assert served.url == server[0] and served.url.startswith("http://127.0.0.1:") and served.proc.poll() is None
    served.proc.kill()
    served.proc.wait()
    again = play(tokenizer, SPEC, kwargs, seeds(1), ["apple"], tool_parser=None)
    assert again[0].episode.reward == 2.0 and adapter.server(APP) is not served


def test_one_of_url_and_app():
    with pytest.raises(ValueError, match="exactly one of url"):
        adapter.OpenEnv()
    with pytest.raises(ValueError, match="exactly one of url"):
        adapter.OpenEnv(url="http://127.0.0.1:1", app=APP)


def test_a_server_that_dies_fails_its_episodes_under_on_error(tokenizer):  # last: kills the server
    served = adapter.server(APP)
    url = served.url
    served.proc.send_signal(signal.SIGKILL)
    served.proc.wait()
    with pytest.raises(EnvError, match=r"OpenEnv.start failed in episode ep.0: ConnectionError"):
        play(tokenizer, SPEC, {"url": url}, seeds(1), ["apple"], tool_parser=None)
    [zero] = play(tokenizer, SPEC, {"url": url}, seeds(1), ["apple"], tool_parser=None, on_error="zero")
    assert (zero.episode.cut, zero.episode.reward) == ("env_error", 0.0)
