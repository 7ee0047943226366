"""Episodes with a scripted sampler and environment: the trajectory's tokens, loss mask and per-token versions
checked by hand, the budgets' cut reasons, an environment's time-out and failure, and the chat-template deltas of
the tiny model's tokenizer (tools in its Hermes format) against rendering the whole conversation."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import numpy as np
import pytest

from distrl.agents.chat import ChatRenderer
from distrl.agents.env import Start, Step, Turn
from distrl.agents.episode import EpisodeRunner, as_rollouts
from distrl.agents.host import EnvError, EnvHost, EnvLost
from distrl.agents.trajectory import TURN_STRIDE, Budget, Sampled, drift, turn_seed
from distrl.config import ModelConfig
from distrl.workers.model_files import load_tokenizer

EOS = 99


class Script:
    """A sampler that answers turn k with `turns[k]` (ids, then EOS unless the turn is cut), sampled by the version
    `version` holds at the time; it records the prompts and seeds it was given."""

    def __init__(self, turns: list[list[int]], echo_extra: int = 0):
        self.turns, self.echo_extra = turns, echo_extra
        self.version = 0
        self.prompts: list[list[int]] = []
        self.seeds: list[int] = []

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Sampled:
        self.prompts.append(list(prompt_ids))
        self.seeds.append(seed)
        ids = self.turns[len(self.prompts) - 1] + [EOS]
        reason = "stop"
        if len(ids) > max_tokens:
            ids, reason = ids[:max_tokens], "length"
        echoed = list(prompt_ids) + [0] * self.echo_extra
        return Sampled(echoed, ids, [-0.5] * len(ids), [self.version] * len(ids), f"turn{len(self.prompts)}", reason)


class FixedChat:
    """Observations are [70 + k] * len(messages) for the k-th answer; no template drift."""

    def __init__(self):
        self.k = 0

    def prompt_ids(self, messages, tools):
        return [1, 2]

    def observation_ids(self, messages, tools, end_of_turn):
        assert end_of_turn == EOS
        self.k += 1
        return [70 + self.k] * len(messages)

    def template_drift(self, messages, tools, trajectory):
        return False


class Countdown:
    """Answers every turn with one message; done (reward 1) at turn `turns - 1`, reward 0.25 on the turns before."""

    def __init__(self, turns: int = 3, sleep: float = 0.0, fail_at: int | None = None):
        self.turns, self.sleep, self.fail_at = turns, sleep, fail_at

    async def start(self, row: dict[str, Any]) -> Start:
        return Start(messages=[{"role": "user", "content": row["q"]}])

    async def step(self, turn: Turn) -> Step:
        await asyncio.sleep(self.sleep)
        if turn.index == self.fail_at:
            raise ZeroDivisionError("the environment's own bug")
        if turn.index == self.turns - 1:
            return Step(reward=1.0, done=True)
        return Step(messages=[{"role": "user", "content": "go on"}], reward=0.25)


BUDGET = Budget(max_turns=8, max_tokens=100, context=200, max_new_tokens=10)


def run(sampler, envs, budget=BUDGET):
    runner = EpisodeRunner(sampler, FixedChat(), budget, envs, end_of_turn=EOS)
    [result] = asyncio.run(runner.run("7.1", [1, 2], {"q": "?"}, seed=1000, sample=1))
    return result


def host(**kwargs):
    spec = kwargs.pop("spec", "tests.agent_tests.test_episode:Countdown")
    return EnvHost(spec, kwargs, step_timeout_s=kwargs.pop("timeout", 5.0), on_error=kwargs.pop("on_error", "raise"))


def test_a_three_turn_episode_is_its_turns_and_observations_with_only_the_turns_trained():
    sampler = Script([[10, 11], [12], [13, 14, 15]])
    result = run(sampler, host(turns=3))
    t = result.trajectory
    # prompt [1, 2]; turn 1 = 10 11 EOS; observation 71; turn 2 = 12 EOS; observation 72; turn 3 = 13 14 15 EOS.
    assert t.prompt_ids == [1, 2]
    assert t.response_ids == [10, 11, EOS, 71, 12, EOS, 72, 13, 14, 15, EOS]
    assert t.mask == [1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1]
    assert t.logprobs == [-0.5, -0.5, -0.5, 0.0, -0.5, -0.5, 0.0, -0.5, -0.5, -0.5, -0.5]
    # Each turn's prompt is exactly the trajectory so far: what the engine was given.
    assert sampler.prompts == [[1, 2], [1, 2, 10, 11, EOS, 71], [1, 2, 10, 11, EOS, 71, 12, EOS, 72]]
    assert sampler.seeds == [turn_seed(1000, 1, k) for k in range(3)] and sampler.seeds[0] == 1001
    e = result.episode
    assert (e.turns, e.reward, e.cut, e.drift, e.template_drift) == (3, 1.5, None, 0, False)  # 0.25 + 0.25 + 1


def test_each_token_carries_the_version_that_sampled_it_when_the_engine_switches_between_turns():
    sampler = Script([[10], [11], [12]])

    class Switching(Countdown):
        async def step(self, turn: Turn) -> Step:
            sampler.version = turn.index + 4  # a push lands while the environment works on turn `index`
            return await super().step(turn)

    result = run(sampler, _host_of(Switching))
    # turn 1 by v0, observation after it stamped v4 (the engine's version when it was appended), turn 2 by v4 ...
    assert result.trajectory.versions == [0, 0, 4, 4, 4, 5, 5, 5]
    assert result.trajectory.mask == [1, 1, 0, 1, 1, 0, 1, 1]


def _host_of(cls: type) -> EnvHost:
    h = host()
    h.cls = cls
    return h


def test_budgets_cut_the_episode_and_say_why():
    endless = [[10]] * 20
    assert run(Script(endless), host(turns=100)).episode.cut == "max_turns"
    # 2 tokens per turn + 1 observation token: after 3 turns and 2 observations 8 tokens, the 3rd observation
    # would make 9 > max_tokens - 1.
    cut = run(Script(endless), host(turns=100), Budget(max_turns=50, max_tokens=9, context=200, max_new_tokens=10))
    assert cut.episode.cut == "max_tokens" and len(cut.trajectory.response_ids) == 8
    assert cut.trajectory.mask[-1] == 1  # an episode never ends on an observation
    # A turn cut at max_new_tokens (21 tokens asked, 10 allowed) goes on: EOS is given (masked), then the answer.
    long_turn = run(Script([list(range(20, 40)), [10]]), host(turns=2))
    assert long_turn.episode.cut is None and long_turn.episode.turns == 2
    assert long_turn.trajectory.response_ids == [*range(20, 30), EOS, 71, 10, EOS]
    assert long_turn.trajectory.mask == [1] * 10 + [0, 0, 1, 1]
    assert run(Script(endless), host(turns=100), Budget(8, 100, 9, 10)).episode.cut == "context"


def test_a_step_past_its_time_limit_ends_the_episode_with_that_reason():
    result = run(Script([[10]] * 3), host(turns=3, sleep=2.0, timeout=0.2))
    assert result.episode.cut == "env_timeout" and result.episode.turns == 1
    assert result.episode.env_wait_s == pytest.approx(0.2, abs=0.15)


def test_an_environment_that_raises_ends_the_run_naming_class_episode_and_line():
    with pytest.raises(EnvError) as err:
        run(Script([[10]] * 3), host(turns=3, fail_at=1))
    message = str(err.value)
    assert "tests.agent_tests.test_episode:Countdown.step failed in episode 7.1: ZeroDivisionError" in message
    assert "test_episode.py" in message and 'raise ZeroDivisionError("the environment\'s own bug")' in message


def test_with_on_error_zero_a_raising_environment_scores_its_episode_zero():
    result = run(Script([[10]] * 3), host(turns=3, fail_at=1, on_error="zero"))
    assert (result.episode.cut, result.episode.reward, result.episode.turns) == ("env_error", 0.0, 2)


def test_an_environment_must_answer_with_the_protocols_types():
    class Sloppy(Countdown):
        async def step(self, turn: Turn) -> Any:
            return {"done": True}

    with pytest.raises(EnvError, match=r"returned dict, expected distrl.agents.env.Step"):
        run(Script([[10]]), _host_of(Sloppy))


@pytest.mark.parametrize(("spec", "problem"), [
    ("tests.agent_tests.test_episode", "must be written 'package.module:Class'"),
    ("tests.agent_tests.no_such_module:Env", "cannot import module"),
    ("tests.agent_tests.test_episode:Nope", "has no attribute 'Nope'"),
    ("tests.agent_tests.test_episode:run", "is a function, not a class"),
    ("tests.agent_tests.test_episode:FixedChat", "start must be an 'async def' method"),
])
def test_an_environment_spec_is_checked_when_it_is_resolved(spec, problem):
    with pytest.raises(ValueError, match=problem):
        host(spec=spec)


def test_drift_counts_positions_and_length():
    assert drift([1, 2, 3], [1, 2, 3]) == 0
    assert drift([1, 9, 3], [1, 2, 3]) == 1
    assert drift([1, 2, 3, 4], [1, 2, 3]) == 1
    assert run(Script([[10], [11]], echo_extra=1), host(turns=2)).episode.drift == 2  # one per turn


def test_turn_seeds_are_the_first_turns_then_a_stride_apart():
    # turn 0 of sample 2 is vLLM's own seed for the third of n samples (base + 2); turn 3 is 3 strides further.
    assert turn_seed(1000, 2, 0) == 1002
    assert turn_seed(1000, 2, 3) == 1002 + 3 * 0x9E3779B9 == 7963308309
    assert turn_seed(2**56 - 1, 1023, 4095) < 2**63  # vLLM refuses seeds from 2**63


def test_the_turns_of_a_sample_draw_different_streams_on_a_cpu_generator():
    # A CPU torch generator (vLLM's sampler on CPU) is seeded from the seed's low 32 bits only: turns whose seeds
    # differed above them (a stride of 2**32) drew the first turn's noise again, so a partial rollout that outlived
    # its first slice never ended (issue 37). Every (sample, turn) of a prompt must have its own stream.
    import torch

    base = 0x00AB_CDEF_1234_5678  # a request seed: 56 bits of a hash
    seeds = [turn_seed(base, j, t) for j in range(8) for t in range(64)]
    assert len({s & 0xFFFF_FFFF for s in seeds}) == len(seeds)
    streams = {tuple(torch.randint(0, 2**31, (4,), generator=torch.Generator().manual_seed(s)).tolist())
               for s in seeds}
    assert len(streams) == len(seeds)


# ------------------------------------------------------------------------------- the tiny model's chat template
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


def test_deltas_of_the_tiny_template_build_the_conversation_token_for_token(tokenizer):
    """Prompt, a turn with a tool call (its canonical tokens and EOS), the tool's answer as a delta: the same ids as
    rendering the whole conversation and tokenizing it."""
    chat = ChatRenderer(tokenizer)
    messages = [{"role": "system", "content": "Use the calculator."}, {"role": "user", "content": "What is 2+3?"}]
    prompt = chat.prompt_ids(messages, TOOLS)
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                             "arguments": {"expression": "2+3"}}}]}
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    turn = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
    answer = [{"role": "tool", "content": "5"}]
    observation = chat.observation_ids(answer, TOOLS, tokenizer.eos_token_id)
    whole = tokenizer.apply_chat_template([*messages, call, *answer], tools=TOOLS, tokenize=False,
                                          add_generation_prompt=True)
    assert prompt + turn + observation == tokenizer.encode(whole, add_special_tokens=False)
    assert tokenizer.decode(observation) == "\n<|user|>\n<tool_response>\n5\n</tool_response><|eos|>\n<|assistant|>\n"
    assert not chat.template_drift([*messages, call], TOOLS, prompt + turn)
    assert chat.template_drift([*messages, call], TOOLS, prompt + turn[:-3] + [turn[-3] + 1] + turn[-2:])


def test_a_turn_ended_by_a_token_the_template_does_not_write_cannot_take_an_observation(tokenizer):
    with pytest.raises(ValueError, match="does not end an assistant message with the token the turn ended with"):
        ChatRenderer(tokenizer).observation_ids([{"role": "user", "content": "x"}], [], tokenizer.bos_token_id)


def test_the_rollout_worker_has_no_coroutine_methods():
    """Ray runs a class with any `async def` method as an asyncio actor, where `generate`'s own event loop cannot
    start: episodes' coroutines live outside the class."""
    import inspect

    from distrl.workers.rollout.worker import RolloutWorker

    assert not [name for name, fn in inspect.getmembers(RolloutWorker) if inspect.iscoroutinefunction(fn)]


class Losing:
    """A client whose host dies during the first `lost` steps it is asked for (`EnvLost`), then serves from `host`."""

    def __init__(self, host: EnvHost, lost: int):
        self.host, self.lost, self.ended = host, lost, []

    async def start(self, episode, row):
        return await self.host.start(episode, row)

    async def step(self, episode, turn):
        if self.lost:
            self.lost -= 1
            raise EnvLost("environment actor env-0 died")
        return await self.host.step(episode, turn)

    def end(self, episode):
        self.ended.append(episode)
        self.host.end(episode)


def test_an_episode_whose_environment_host_died_runs_again_from_its_first_turn():
    sampler = Script([[10]] * 4)
    client = Losing(host(turns=2), lost=1)
    runner = EpisodeRunner(sampler, FixedChat(), BUDGET, client, end_of_turn=EOS, max_restarts=1)
    [result] = asyncio.run(runner.run("7.1", [1, 2], {"q": "?"}, seed=1000, sample=1))
    assert (result.episode.restarts, result.episode.turns, result.episode.reward) == (1, 2, 1.25)
    assert result.trajectory.response_ids[:2] == [10, EOS] and result.trajectory.mask.count(0) == 1
    assert sampler.seeds == [1001, 1001, 1001 + TURN_STRIDE]  # the restart samples with the same seeds again
    assert client.ended == ["7.1", "7.1.r1"]
    with pytest.raises(EnvLost, match=r"episode 7.1: its environment's host died 2 times, more than "):
        asyncio.run(EpisodeRunner(Script([[10]] * 4), FixedChat(), BUDGET, Losing(host(turns=2), lost=2),
                                  end_of_turn=EOS, max_restarts=1).run("7.1", [1, 2], {"q": "?"}, 1000, 1))


def test_a_host_started_again_does_not_know_the_episodes_of_the_one_before():
    with pytest.raises(EnvLost, match="was restarted since the episode began"):
        asyncio.run(host(turns=2).step("3.0", Turn("t", "t", [], None, 0)))


class Routing(Script):
    """A sampler that also returns routes as vLLM does (`rollout.routing_replay`): for every token it fed through
    the model (the prompt and the turn's tokens but the last), layer 0's expert is the token id mod 7 and layer 1's
    the turn's number."""

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Sampled:
        turn = await super().sample(prompt_ids, max_tokens, seed)
        fed = [*turn.prompt_ids, *turn.token_ids][:-1]
        routes = np.array([[[i % 7], [len(self.prompts)]] for i in fed], dtype=np.uint8)  # [n, L=2, k=1]
        return dataclasses.replace(turn, routes=routes)


def test_an_episode_carries_the_routes_of_its_last_turn_which_cover_every_token_but_its_last():
    result = run(Routing([[10, 11], [12], [13, 14, 15]]), host(turns=3))
    t = result.trajectory
    ids = [*t.prompt_ids, *t.response_ids]
    # The third turn was given the whole trajectory (prompt, turns 1-2 and both observations): its routes are those
    # of all of it and of its own tokens but the final EOS, 14 of the 15 tokens.
    assert t.routes.shape == (len(ids) - 1, 2, 1)
    assert t.routes[:, 0, 0].tolist() == [i % 7 for i in ids[:-1]] and set(t.routes[:, 1, 0].tolist()) == {3}
    rows = as_rollouts([[result]], [0], 1, version=0)
    assert rows.routes[0] is t.routes
    # Turns echoing other ids than the trajectory (drift) routed other tokens: their routes are not taken.
    drifted = run(Routing([[10], [11]], echo_extra=1), host(turns=2)).trajectory
    assert drifted.routes is None
