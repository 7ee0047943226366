"""Environments for the agent tests (importable by rollout actors: `tests.agent_envs:Class`)."""

from __future__ import annotations

import asyncio
from typing import Any

from distrl.agents.env import Start, Step, Turn

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}}}}}]


class Chatter:
    """Answers turn k with a tool message "result k" after `sleep` seconds; done after `turns` turns, with reward 1
    if the last turn mentions a digit (a random model's answers vary, so groups have a signal)."""

    def __init__(self, turns: int = 3, sleep: float = 0.0):
        self.turns, self.sleep = turns, sleep

    async def start(self, row: dict[str, Any]) -> Start:
        return Start(messages=[{"role": "user", "content": row["prompt"]}], tools=TOOLS)

    async def step(self, turn: Turn) -> Step:
        await asyncio.sleep(self.sleep)  # a tool's latency
        if turn.index == self.turns - 1:
            return Step(reward=float(any(c.isdigit() for c in turn.text)), done=True)
        return Step(messages=[{"role": "tool", "content": f"result {turn.index}"}])


# ----------------------------------------------------------------------------- agent functions (env.agent)
async def tool_agent(client: Any, row: dict[str, Any], turns: int = 2, fresh: bool = False,
                     sleep: float = 0.0) -> float:
    """An agent as a user writes one with the OpenAI client: `turns` calls in one conversation, each answered with
    a tool message "result k"; with `fresh`, one more call on a new conversation (a summary of the first), which
    is not a continuation. Reward 1 if the last reply mentions a digit."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": row["prompt"]}]
    reply = None
    for k in range(turns):
        out = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        reply = out.choices[0].message
        messages.append(reply.model_dump(exclude_none=True))
        messages.append({"role": "tool", "content": f"result {k}", "tool_call_id": "x"})
        await asyncio.sleep(sleep)
    if fresh:
        summary = [{"role": "user", "content": f"Summarise: {reply.content if reply else ''}"}]
        reply = (await client.chat.completions.create(model="policy", messages=summary)).choices[0].message
    return float(any(c.isdigit() for c in (reply.content or "") if reply is not None))


async def broken_agent(client: Any, row: dict[str, Any]) -> float:
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["prompt"]}])
    return 1 / 0


async def slow_agent(client: Any, row: dict[str, Any]) -> float:
    await asyncio.sleep(30)
    return 1.0


async def wordy_agent(client: Any, row: dict[str, Any]) -> str:
    return "full marks"


async def rowless_agent(client: Any) -> float:
    return 1.0
