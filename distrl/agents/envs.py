"""Built-in environments.

`ToolEnvironment`: the model answers a dataset question, calling tools along the way. A turn with tool calls is
answered with each call's result (a `tool` message per call); a turn with a call that could not be parsed is
answered with the parse error; a turn without a call is the final answer, scored by a reward function
(`package.module:function`, as `reward.function`) and ends the episode. It is what most tool-use training runs
(calculators, code execution, search over a local index) need, and a short example of the protocol to copy.
"""

from __future__ import annotations

import asyncio
from typing import Any

from distrl.agents.env import Start, Step, Turn
from distrl.agents.tools.base import Tool, ToolResult, resolve_tool
from distrl.workers.rewards import resolve_reward, reward_and_info


class ToolEnvironment:
    """`tools`: built-in names (`calculator`, `python`), `package.module:Class` specs, or `{"spec": ..., "kwargs":
    {...}}`; `reward`: the function scoring the final answer; `system_prompt`: a system message before the row's
    prompt; `prompt_key`: the row's field holding the prompt (a string, or chat messages)."""

    def __init__(self, tools: list[str | dict[str, Any]], reward: str = "distrl.workers.rewards:exact_match",
                 system_prompt: str | None = None, prompt_key: str = "prompt"):
        self.tools: dict[str, Tool] = {}
        for spec in tools:
            tool = (resolve_tool(spec["spec"], spec.get("kwargs")) if isinstance(spec, dict)
                    else resolve_tool(spec, None))
            self.tools[tool.name] = tool
        self.reward = resolve_reward(reward)
        self.system_prompt, self.prompt_key = system_prompt, prompt_key
        self.row: dict[str, Any] = {}

    async def start(self, row: dict[str, Any]) -> Start:
        self.row = row
        prompt = row[self.prompt_key]
        messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        if self.system_prompt is not None:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Start(messages=messages, tools=[t.schema() for t in self.tools.values()])

    async def step(self, turn: Turn) -> Step:
        if turn.parse_error is not None:
            return Step(messages=[{"role": "tool", "content": turn.parse_error}], tool_errors=1)
        if not turn.tool_calls:
            prompt = self.row[self.prompt_key]
            scored = await asyncio.to_thread(self.reward, prompt if isinstance(prompt, str) else str(prompt),
                                             turn.content, self.row)
            reward, _ = reward_and_info(scored)  # the info of a reward that gives one has no place in a Step
            return Step(reward=reward, done=True)
        results = await asyncio.gather(*(self._call(c.name, c.arguments) for c in turn.tool_calls))
        return Step(messages=[{"role": "tool", "name": c.name, "content": r.content}
                              for c, r in zip(turn.tool_calls, results, strict=True)],
                    tool_errors=sum(r.error is not None for r in results))

    async def _call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        tool = self.tools.get(name)
        if tool is None:
            return ToolResult(f"unknown tool {name!r}; the tools are: {', '.join(self.tools)}", "unknown_tool")
        return await tool.call(arguments)
