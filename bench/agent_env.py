"""The environment of `bench_agent.py`: every turn's tool call takes a fixed latency (a sleep standing in for a
sandbox or a remote service), drawn per episode and turn from [low, high] seconds."""

from __future__ import annotations

import asyncio
import random
from typing import Any

from distrl.agents.env import Start, Step, Turn


class SlowTools:
    def __init__(self, turns: int = 3, low: float = 0.2, high: float = 0.5):
        self.turns, self.low, self.high = turns, low, high
        self.rng = random.Random()

    async def start(self, row: dict[str, Any]) -> Start:
        self.rng.seed(row["prompt"])
        return Start(messages=[{"role": "user", "content": row["prompt"]}])

    async def step(self, turn: Turn) -> Step:
        if turn.index == self.turns - 1:
            return Step(reward=float(any(c.isdigit() for c in turn.text)), done=True)
        await asyncio.sleep(self.rng.uniform(self.low, self.high))
        return Step(messages=[{"role": "user", "content": f"tool result {turn.index}"}])
