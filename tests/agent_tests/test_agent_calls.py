"""Agent functions' calls (`env.agent`), with a scripted sampler and the tiny model's real tokenizer and chat
template: a call that continues an earlier one is token-exact (the earlier ids, the sampled ids, the new messages
as a template delta), any other call begins a sequence of its own, budgets refuse calls and record the cut; then
the endpoint over HTTP with the real OpenAI client, and agent functions run by `AgentHost` through the episode
runner."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

from distrl.agents.agent import AgentHost, resolve_agent
from distrl.agents.calls import AgentCalls, CallRefused
from distrl.agents.chat import ChatRenderer
from distrl.agents.episode import EpisodeRunner
from distrl.agents.host import EnvError
from distrl.agents.server import AgentServer
from distrl.agents.tool_calls import ToolCallParser
from distrl.agents.trajectory import Budget, Sampled, turn_seed
from distrl.config import ModelConfig
from distrl.workers.model_files import load_tokenizer
from tests.agent_envs import TOOLS

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
BUDGET = Budget(max_turns=4, max_tokens=400, context=1000, max_new_tokens=100)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(ModelConfig(path=str(tiny_model_dir)))


class Texts:
    """A sampler that answers call k with the ids of `texts[k]` and EOS (cut to `max_tokens`), sampled by version
    `version`; it records prompts, seeds and limits."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts = tokenizer, texts
        self.version = 3
        self.prompts: list[list[int]] = []
        self.seeds: list[int] = []
        self.limits: list[int] = []

    async def sample(self, prompt_ids, max_tokens, seed):
        self.prompts.append(list(prompt_ids))
        self.seeds.append(seed)
        self.limits.append(max_tokens)
        text = self.texts[len(self.prompts) - 1]
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        reason = "stop"
        if len(ids) > max_tokens:
            ids, reason = ids[:max_tokens], "length"
        return Sampled(list(prompt_ids), ids, [-0.25] * len(ids), [self.version] * len(ids), text, reason, 0.01)


def calls_for(tokenizer, texts, budget=BUDGET):
    sampler = Texts(tokenizer, texts)
    parser = ToolCallParser("hermes", tokenizer)
    return sampler, AgentCalls(sampler, ChatRenderer(tokenizer), budget, parser, tokenizer.eos_token_id,
                               seed=1000, sample=2)


def test_a_call_that_continues_the_last_one_is_its_ids_the_sampled_ids_and_the_new_messages_as_a_delta(tokenizer):
    sampler, calls = calls_for(tokenizer, [CALL, "It is 5."])
    chat = ChatRenderer(tokenizer)
    user = [{"role": "user", "content": "What is 2+3?"}]
    first = asyncio.run(calls.complete({"model": "m", "messages": user, "tools": TOOLS}))
    message = first["choices"][0]["message"]
    assert first["choices"][0]["finish_reason"] == "tool_calls" and message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {
        "expression": "2+3"}
    # The agent sends the reply back re-serialised (other spacing, an id of its own) with the tool's answer.
    call["function"]["arguments"] = '{"expression":"2+3"}'
    call["id"] = "call-from-the-agent"
    tool = [{"role": "tool", "content": "5", "tool_call_id": "call-from-the-agent"}]
    second = asyncio.run(calls.complete({"model": "m", "messages": [*user, message, *tool], "tools": TOOLS}))
    assert second["choices"][0]["message"] == {"role": "assistant", "content": "It is 5."}
    turn1 = [*tokenizer.encode(CALL, add_special_tokens=False), tokenizer.eos_token_id]
    observation = chat.observation_ids(tool, TOOLS, tokenizer.eos_token_id)
    assert sampler.prompts[1] == chat.prompt_ids(user, TOOLS) + turn1 + observation
    assert second["prompt_token_ids"] == sampler.prompts[1]
    assert sampler.seeds == [turn_seed(1000, 2, 0), turn_seed(1000, 2, 1)]
    [result] = calls.results(1.0, [7], wall_s=0.5)
    traj = result.trajectory
    turn2 = [*tokenizer.encode("It is 5.", add_special_tokens=False), tokenizer.eos_token_id]
    assert traj.prompt_ids == chat.prompt_ids(user, TOOLS)
    assert traj.response_ids == turn1 + observation + turn2
    assert traj.mask == [1] * len(turn1) + [0] * len(observation) + [1] * len(turn2)
    assert traj.logprobs == [-0.25] * len(turn1) + [0.0] * len(observation) + [-0.25] * len(turn2)
    assert traj.versions == [3] * len(traj.response_ids)
    e = result.episode
    assert (e.turns, e.tool_calls, e.reward, e.cut, e.drift, e.segment, e.template_drift) == (
        2, 1, 1.0, None, 0, 0, False)
    assert e.engine_s == pytest.approx(0.02) and 0.0 <= e.env_wait_s <= 0.5
    assert result.text == CALL + "It is 5." and result.finish_reason == "stop"


def test_a_call_on_a_rewritten_conversation_begins_a_sequence_of_its_own(tokenizer):
    sampler, calls = calls_for(tokenizer, ["Four.", "Five.", "Six.", "Seven."])
    chat = ChatRenderer(tokenizer)
    user = [{"role": "user", "content": "Count."}]
    first = asyncio.run(calls.complete({"messages": user}))["choices"][0]["message"]
    # The agent writes its own assistant turn: not what the model sampled.
    asyncio.run(calls.complete({"messages": [*user, {"role": "assistant", "content": "Three."},
                                             {"role": "user", "content": "Next?"}]}))
    # A summary on a fresh conversation, then a continuation of the first sequence, which is still open.
    asyncio.run(calls.complete({"messages": [{"role": "user", "content": "Summarise."}]}))
    asyncio.run(calls.complete({"messages": [*user, first, {"role": "user", "content": "More?"}]}))
    assert sampler.prompts[0] == chat.prompt_ids(user, [])
    assert sampler.prompts[3][: len(sampler.prompts[0])] == sampler.prompts[0]
    results = calls.results(0.5, [7], wall_s=1.0)
    assert [r.episode.segment for r in results] == [0, 1, 2]
    assert [r.text for r in results] == ["Four.Seven.", "Five.", "Six."]
    assert [r.episode.reward for r in results] == [0.5] * 3
    assert [r.episode.turns for r in results] == [4, 0, 0]
    assert results[0].trajectory.mask.count(0) == len(chat.observation_ids([{"role": "user", "content": "More?"}],
                                                                          [], tokenizer.eos_token_id))


def test_calls_past_the_budgets_are_refused_and_the_episode_recorded_as_cut(tokenizer):
    sampler, calls = calls_for(tokenizer, ["a"] * 5, Budget(max_turns=2, max_tokens=400, context=1000,
                                                            max_new_tokens=40))
    user = [{"role": "user", "content": "Go."}]
    for _ in range(2):
        asyncio.run(calls.complete({"messages": user}))
    with pytest.raises(CallRefused, match=r"env\.max_turns = 2 calls") as refused:
        asyncio.run(calls.complete({"messages": user}))
    assert (refused.value.status, refused.value.budget, calls.cut) == (400, "max_turns", "max_turns")
    # A sequence at its token budget: the call is refused, the turn's limit is the room that is left.
    on = [{"role": "user", "content": "on"}]
    observation = 1 + len(ChatRenderer(tokenizer).observation_ids(on, [], tokenizer.eos_token_id))  # EOS given
    sampler, calls = calls_for(tokenizer, ["a b c d e f g h i j"] * 3,
                               Budget(max_turns=8, max_tokens=5 + observation + 3, context=1000, max_new_tokens=40))
    out = asyncio.run(calls.complete({"messages": user, "max_tokens": 5}))
    assert sampler.limits == [5] and out["choices"][0]["finish_reason"] == "length"
    reply = out["choices"][0]["message"]
    asyncio.run(calls.complete({"messages": [*user, reply, *on]}))
    assert sampler.limits == [5, 3]
    assert calls.sequences[0].trajectory.mask == [1] * 5 + [0] * observation + [1] * 3
    with pytest.raises(CallRefused, match="max_tokens budget"):
        asyncio.run(calls.complete({"messages": [*user, reply, {"role": "user", "content": "on"},
                                                 calls.sequences[0].messages[-1],
                                                 {"role": "user", "content": "and on"}]}))
    assert calls.cut == "max_tokens" and len(calls.results(0.0, [7], 0.0)) == 1


@pytest.mark.parametrize(("body", "message"), [
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "streaming is not served"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n must be 1"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"content": "x"}]}, "every message needs a 'role'"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text content parts"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"name": "f"}]}]}, "tool_calls must be a list of"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["Observation:"]}, "'stop' is not served"),
])
def test_requests_distrl_cannot_serve_are_refused_with_the_reason(tokenizer, body, message):
    with pytest.raises(CallRefused, match=message):
        asyncio.run(calls_for(tokenizer, ["a"])[1].complete(body))


# ------------------------------------------------------------------------------------------- over HTTP
def test_the_endpoint_serves_the_openai_client(tokenizer):
    async def scenario():
        server = AgentServer()
        url = await server.start("127.0.0.1")
        try:
            sampler, calls = calls_for(tokenizer, [CALL, "It is 5."], Budget(2, 400, 1000, 100))
            client = openai.AsyncOpenAI(base_url=server.open("4.1", calls), api_key="distrl", max_retries=0)
            messages = [{"role": "user", "content": "What is 2+3?"}]
            out = await client.chat.completions.create(model="anything", messages=messages, tools=TOOLS,
                                                       logprobs=True)
            reply = out.choices[0].message
            assert reply.tool_calls[0].function.name == "calculator" and out.usage.completion_tokens == len(
                sampler.prompts and calls.sequences[0].trajectory.response_ids)
            assert [c.logprob for c in out.choices[0].logprobs.content] == [-0.25] * out.usage.completion_tokens
            messages += [reply.model_dump(exclude_none=True), {"role": "tool", "content": "5", "tool_call_id": "1"}]
            out = await client.chat.completions.create(model="anything", messages=messages, tools=TOOLS)
            assert out.choices[0].message.content == "It is 5." and len(calls.sequences) == 1
            with pytest.raises(openai.BadRequestError, match=r"env\.max_turns = 2 calls"):
                await client.chat.completions.create(model="anything", messages=messages)
            assert [m.id for m in (await client.models.list()).data] == ["distrl-policy"]
            server.close("4.1")
            with pytest.raises(openai.NotFoundError, match=r"no episode at /episodes/4\.1\.\S+/v1/chat/completions"):
                await client.chat.completions.create(model="anything", messages=messages)
            assert url.startswith("http://127.0.0.1:") and str(client.base_url).startswith(f"{url}/episodes/4.1.")
        finally:
            await server.stop()

    asyncio.run(scenario())


# --------------------------------------------------------------------------- agent functions, end to end
class Hosted:
    """The environment client of one `AgentHost` in this process."""

    def __init__(self, host: AgentHost):
        self.host = host

    async def run(self, episode, row, base_url):
        return await self.host.run(episode, row, base_url)

    def end(self, episode):
        self.host.end(episode)


class Failing(Texts):
    """An engine that fails at its second turn."""

    async def sample(self, prompt_ids, max_tokens, seed):
        if self.prompts:
            raise RuntimeError("the engine failed earlier: out of KV cache blocks")
        return await super().sample(prompt_ids, max_tokens, seed)


def play(tokenizer, texts, spec, kwargs=None, timeout=10.0, on_error="raise", budget=BUDGET, sampler_class=Texts):
    async def scenario():
        server = AgentServer()
        await server.start("127.0.0.1")
        try:
            sampler = sampler_class(tokenizer, texts)
            runner = EpisodeRunner(sampler, ChatRenderer(tokenizer), budget,
                                   Hosted(AgentHost(spec, kwargs or {}, timeout, on_error)),
                                   ToolCallParser("hermes", tokenizer), tokenizer.eos_token_id, endpoint=server)
            return await runner.run("9.0", [5, 6], {"prompt": "What is 2+3?"}, seed=1000, sample=0)
        finally:
            await server.stop()

    return asyncio.run(scenario())


def test_an_agent_function_plays_its_episode_through_the_endpoint(tokenizer):
    results = play(tokenizer, [CALL, "It is 5.", "Said 5."], "tests.agent_envs:tool_agent",
                   {"turns": 2, "fresh": True})
    assert [r.episode.segment for r in results] == [0, 1]
    assert [r.episode.reward for r in results] == [1.0, 1.0]  # "Said 5." has a digit
    first = results[0]
    assert (first.episode.turns, first.episode.tool_calls, first.episode.drift) == (3, 1, 0)
    assert first.trajectory.mask.count(1) == len(tokenizer.encode(CALL + "It is 5.", add_special_tokens=False)) + 2


def test_an_agent_that_raises_ends_the_run_naming_its_line_or_scores_zero(tokenizer):
    with pytest.raises(EnvError, match=r"agent tests.agent_envs:broken_agent failed in episode 9.0: "
                                       r"ZeroDivisionError.*agent_envs.py:\d+ in broken_agent: return 1 / 0"):
        play(tokenizer, ["a"], "tests.agent_envs:broken_agent")
    [result] = play(tokenizer, ["a"], "tests.agent_envs:broken_agent", on_error="zero")
    assert (result.episode.cut, result.episode.reward, result.episode.turns) == ("env_error", 0.0, 1)
    [result] = play(tokenizer, [], "tests.agent_envs:slow_agent", timeout=0.2)
    assert (result.episode.cut, result.episode.reward, result.trajectory.prompt_ids) == ("env_timeout", 0.0, [5, 6])
    with pytest.raises(EnvError, match="returned 'full marks', expected a finite float reward"):
        play(tokenizer, [], "tests.agent_envs:wordy_agent")


def test_an_agent_refused_for_its_budget_is_cut_not_broken(tokenizer):
    [result] = play(tokenizer, [CALL, CALL], "tests.agent_envs:tool_agent", {"turns": 3},
                    budget=Budget(2, 400, 1000, 100))
    assert (result.episode.cut, result.episode.reward, result.episode.turns) == ("max_turns", 0.0, 2)


def test_agent_functions_are_checked_when_named():
    assert resolve_agent("tests.agent_envs:tool_agent").__name__ == "tool_agent"
    with pytest.raises(ValueError, match="must be an 'async def' function"):
        resolve_agent("tests.agent_envs:TOOLS")
    with pytest.raises(ValueError, match=r"must take \(client, row\)"):
        resolve_agent("tests.agent_envs:rowless_agent")


def test_an_engine_failure_is_raised_as_itself_not_blamed_on_the_agent(tokenizer):
    """The agent sees an HTTP 500 and raises; the episode raises the engine's error, which env.on_error: zero
    would otherwise have scored 0 and hidden."""
    for on_error in ("raise", "zero"):
        with pytest.raises(RuntimeError, match="out of KV cache blocks"):
            play(tokenizer, [CALL, "x"], "tests.agent_envs:tool_agent", {"turns": 2}, on_error=on_error,
                 sampler_class=Failing)
