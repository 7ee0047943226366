"""The built-in `ToolEnvironment`: the row's question with the tools offered, tool calls answered by the tools, a
malformed call answered with its parse error, and the final answer scored by the reward function."""

import asyncio

from distrl.agents.env import Start, Step, ToolCall, Turn
from distrl.agents.envs import ToolEnvironment


def turn(content: str = "", calls: list[ToolCall] | None = None, parse_error: str | None = None) -> Turn:
    return Turn(content, content, calls or [], parse_error, 0)


def test_the_question_comes_with_the_tools_schemas_and_a_system_prompt():
    env = ToolEnvironment(tools=["calculator"], system_prompt="Use the calculator.")
    start = asyncio.run(env.start({"prompt": "What is 6 x 7?", "answer": "42"}))
    assert isinstance(start, Start)
    assert start.messages == [{"role": "system", "content": "Use the calculator."},
                              {"role": "user", "content": "What is 6 x 7?"}]
    assert [t["function"]["name"] for t in start.tools] == ["calculator"]


def test_tool_calls_are_answered_by_the_tools_one_message_each():
    env = ToolEnvironment(tools=["calculator"])
    asyncio.run(env.start({"prompt": "q", "answer": "42"}))
    step = asyncio.run(env.step(turn(calls=[ToolCall("calculator", {"expression": "6 * 7"}),
                                            ToolCall("calculator", {"expression": "1 / 0"}),
                                            ToolCall("search", {"query": "x"})])))
    assert isinstance(step, Step) and not step.done and step.reward is None
    assert [m["role"] for m in step.messages] == ["tool"] * 3
    assert step.messages[0] == {"role": "tool", "name": "calculator", "content": "42"}
    assert "unknown tool 'search'" in step.messages[2]["content"]
    assert step.tool_errors == 2  # division by zero, unknown tool


def test_a_malformed_call_is_answered_with_its_parse_error():
    env = ToolEnvironment(tools=["calculator"])
    asyncio.run(env.start({"prompt": "q", "answer": "42"}))
    step = asyncio.run(env.step(turn("<tool_call>{oops", parse_error="could not parse the tool call")))
    assert step.messages == [{"role": "tool", "content": "could not parse the tool call"}] and step.tool_errors == 1


def test_an_answer_without_a_call_ends_the_episode_scored_by_the_reward_function():
    env = ToolEnvironment(tools=["calculator"], reward="distrl.workers.rewards:numeric_answer")
    asyncio.run(env.start({"prompt": "q", "answer": "42"}))
    assert asyncio.run(env.step(turn("The answer is 42."))) == Step(reward=1.0, done=True)
    assert asyncio.run(env.step(turn("It is 41."))) == Step(reward=0.0, done=True)


def test_the_docs_shortest_example_runs():
    """docs/AGENTS.md's first Python block is a complete environment."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "AGENTS.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    namespace: dict = {}
    exec(compile(code, "docs/AGENTS.md", "exec"), namespace)
    env = namespace["Guess"]()
    asyncio.run(env.start({"answer": "42"}))
    assert asyncio.run(env.step(turn("Is it 17?"))).messages == [{"role": "user", "content": "higher"}]
    assert asyncio.run(env.step(turn("50"))).messages == [{"role": "user", "content": "lower"}]
    assert asyncio.run(env.step(turn("It is 42."))) == Step(reward=1.0, done=True)
