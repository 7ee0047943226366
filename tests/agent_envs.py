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
