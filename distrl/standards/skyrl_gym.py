"""skyrl-gym environments (`BaseTextEnv`: `init`, `step(action) -> observations, reward, done`), as SkyRL runs them.

    data: {path: data/gsm8k.parquet}   # SkyRL's rows: prompt (chat messages), env_class, reward_spec, extra_info
    env:  {class: distrl.standards.skyrl_gym:SkyRLGymEnv, kwargs: {env_config: {}}}

Each episode makes the environment its row names (`env_class`, or the `env_class` kwarg for all rows) with
`skyrl_gym.make(name, env_config=..., extras=row)` as SkyRL's generator does, and starts it on the row's prompt
(`init`); each turn's text is the action, the step's `observations` (chat messages already) are appended, its
reward is the episode's reward for that step (summed), and `done` ends the episode, after which the environment's
`get_metrics()` are the episode's figures (`env/<name>`). The environments' methods are plain functions, run on a
worker thread so that one that waits (a SQL query, a search) holds no other episode up.
"""

from __future__ import annotations

import asyncio
from typing import Any

from distrl.agents.env import Start, Step, Turn
from distrl.standards import numeric, require


class SkyRLGymEnv:
    """An episode of the skyrl-gym environment registered as `env_class` (null: the row's `env_class`), made with
    `env_config`."""

    def __init__(self, env_class: str | None = None, env_config: dict[str, Any] | None = None):
        self.skyrl_gym = require("skyrl_gym")
        from omegaconf import OmegaConf

        self.env_class = env_class
        self.env_config = OmegaConf.create(env_config or {})
        self.env: Any = None

    async def start(self, row: dict[str, Any]) -> Start:
        name = self.env_class or row.get("env_class")
        if not name:
            raise ValueError(f"the row names no env_class and the env_class kwarg is null; the row has {sorted(row)}")
        self.env = await asyncio.to_thread(self.skyrl_gym.make, name, env_config=self.env_config, extras=row)
        prompt = row["prompt"]
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        messages, _ = await asyncio.to_thread(self.env.init, prompt)
        return Start(messages=list(messages))

    async def step(self, turn: Turn) -> Step:
        out = await asyncio.to_thread(self.env.step, turn.text)
        if out["done"]:
            return Step(reward=float(out["reward"]), done=True, metrics=numeric(self.env.get_metrics()))
        return Step(messages=list(out["observations"]), reward=float(out["reward"]))

    def close(self) -> None:
        if self.env is not None:
            self.env.close()
