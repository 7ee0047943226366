"""OpenEnv environments through distrl's episode runner: a server the test starts on 127.0.0.1 (uvicorn, OpenEnv's
`create_app`) shared by many episodes at once, each in a WebSocket session of its own through the environment's own
client, at most `sessions` at once; a server distrl starts itself, whose output never blocks it; and a server that
dies (at the start, between two steps) or hangs ending its episodes under `env.on_error` and `env.step_timeout_s`,
the next episodes getting a server started again."""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest

from distrl.agents.host import EnvError
from distrl.standards import openenv as adapter
from distrl.standards import seeds
from tests.standards.scripted import play

pytest.importorskip("openenv")

from tests.standards import openenv_words as words  # it imports openenv: after the skip

APP = "tests.standards.openenv_words:app"
SPEC = "distrl.standards.openenv:OpenEnv"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from distrl.config import ModelConfig
    from distrl.workers.model_files import load_tokenizer

    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


@pytest.fixture(scope="module")
def server():
    """The module's server, on 127.0.0.1: the one distrl serves `APP` with (`adapter.server`), started once and
    shared by the tests; (its URL, its process). The last tests kill it."""
    served = adapter.server(APP)
    asyncio.run(served.ready(120))
    yield served.url, served.proc
    for running in adapter._SERVERS.values():
        running.stop()


def test_many_episodes_share_one_server_each_in_its_own_session(tokenizer, server):
    url, _ = server
    rows = seeds(6)
    kwargs = {"url": url, "client": "tests.standards.openenv_words:WordEnv",
              "action": "tests.standards.openenv_words:WordAction", "observation_field": "prompt",
              "system_prompt": "Play."}
    results = play(tokenizer, SPEC, kwargs, rows, ["apple", "river"], tool_parser=None)
    for row, result in zip(rows, results, strict=True):
        e = result.episode
        word = words.WORDS[row["seed"]]
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


def test_the_reset_kwargs_reach_the_servers_reset(tokenizer, server):
    url, _ = server
    # The empty word is in every message: both rounds rewarded, whatever the turns say.
    [result] = play(tokenizer, SPEC, {"url": url, "reset": {"word": ""}}, seeds(1), ["river", "x"], tool_parser=None)
    assert (result.episode.turns, result.episode.reward) == (2, 2.0)


def test_a_server_that_hangs_ends_the_episode_at_the_step_time_limit(tokenizer, server):
    url, _ = server
    began = time.monotonic()
    [result] = play(tokenizer, SPEC, {"url": url}, seeds(1), [words.SLOW_WORD], tool_parser=None, timeout_s=1.0)
    assert (result.episode.cut, result.episode.turns) == ("env_timeout", 1)
    assert time.monotonic() - began < 30


def test_a_server_that_writes_much_to_stderr_keeps_answering(tokenizer, server):
    # Six steps of 100 KB each: through a pipe no one reads, the server would block in its first step.
    kwargs = {"app": APP, "observation_field": "prompt"}
    results = play(tokenizer, SPEC, kwargs, seeds(3), [words.LOUD_WORD], tool_parser=None, timeout_s=20.0)
    assert [(r.episode.turns, r.episode.cut) for r in results] == [(2, None)] * 3
    # Its output is kept whole: the loud lines, and after them whatever the server logs as the episodes' sessions
    # close (a disconnect's traceback each, at times; more than tail()'s few KB, so the whole file is read).
    assert words.LOUD_WORD in adapter.server(APP).tail(size=10 * words.LOUD_BYTES)


def test_sessions_caps_the_episodes_at_once_on_a_server(tokenizer):
    # narrow_app refuses a third session at once: six episodes all succeed only if at most two ran at a time,
    # and the client's count shows that two did.
    kwargs = {"app": "tests.standards.openenv_words:narrow_app", "observation_field": "prompt",
              "client": "tests.standards.openenv_words:CountingWordEnv",
              "action": "tests.standards.openenv_words:WordAction"}
    words.CONNECTIONS.update(open=0, most=0)
    capped = play(tokenizer, SPEC, {**kwargs, "sessions": 2}, seeds(6), ["apple", "river"], tool_parser=None)
    assert [r.episode.reward for r in capped] == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert words.CONNECTIONS["most"] == 2
    # Without the cap, the same episodes open more sessions at once than the server takes.
    words.CONNECTIONS.update(open=0, most=0)
    free = play(tokenizer, SPEC, kwargs, seeds(6), ["apple", "river"], tool_parser=None, on_error="zero")
    assert words.CONNECTIONS["most"] > 2 and "env_error" in [r.episode.cut for r in free]


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


def test_a_server_that_dies_between_two_steps_ends_the_episode_and_the_next_gets_a_new_server(tokenizer, caplog):
    kwargs = {"app": APP, "observation_field": "prompt"}

    def kill(turn: int) -> None:
        if turn == 1:  # after the first step's answer, before the second turn reaches the server
            served = adapter.server(APP)
            served.proc.kill()
            served.proc.wait()

    with pytest.raises(EnvError, match=r"OpenEnv.step failed in episode ep.0"):
        play(tokenizer, SPEC, kwargs, seeds(1), ["apple"], tool_parser=None, before_turn=kill)
    [cut] = play(tokenizer, SPEC, kwargs, seeds(1), ["apple"], tool_parser=None, on_error="zero", before_turn=kill)
    assert (cut.episode.turns, cut.episode.cut, cut.episode.reward) == (2, "env_error", 0.0)
    with caplog.at_level(logging.WARNING, logger=adapter.__name__):
        [again] = play(tokenizer, SPEC, kwargs, seeds(1), ["apple"], tool_parser=None)
    assert (again.episode.turns, again.episode.cut, again.episode.reward) == (2, None, 2.0)
    assert f"the OpenEnv server of {APP} exited with -9; starting it again" in caplog.text


def test_a_server_that_cannot_start_says_why_from_its_output():
    served = adapter.Server("tests.standards.openenv_words:no_such_app")
    try:
        # uvicorn's own words, and its exit status for an app it cannot load
        with pytest.raises(RuntimeError, match=r'exited with 3; the end of its output:\n.*"no_such_app" not found'):
            asyncio.run(served.ready(120))
    finally:
        served.stop()


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
