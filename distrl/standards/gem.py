"""gem environments (`gem.make`, `reset`, `step`): Gym's text games and tasks, played turn by turn.

    data: {function: distrl.standards:seeds, kwargs: {count: 1000}}
    env:  {class: distrl.standards.gem:GemEnv, kwargs: {env_id: "game:GuessTheNumber-v0-easy"}}

Each episode makes its environment (`gem.make(env_id, **env_kwargs)`), resets it with the row's `seed`, and shows
the observation to the model as a user message (after `system_prompt`, when given); each turn's text is the
action, each observation after it the next user message, and the step's reward the episode's reward for that step
(summed). `terminated` or `truncated` ends the episode; the numeric values of the step's `info` are the episode's
figures (`env/<name>`). The conversation is the history: gem's wrappers that fold past turns into one observation
(for models that see no history) are not needed.

gem seeds Python's and NumPy's global generators at every reset and its games draw from them, so all gem calls of
a process run one at a time on one thread of their own: a reset and its draws are not interleaved with another
episode's, and the event loop keeps serving the other episodes meanwhile (a step that hangs ends its episode at
`env.step_timeout_s`).
"""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from distrl.agents.env import Start, Step, Turn
from distrl.standards import numeric, require

_GEM = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gem")


async def _in_gem_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(_GEM, functools.partial(fn, *args, **kwargs))


class GemEnv:
    """An episode of gem environment `env_id` (made with `env_kwargs`)."""

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, system_prompt: str | None = None):
        self.gem = require("gem")
        self.env_id, self.env_kwargs, self.system_prompt = env_id, dict(env_kwargs or {}), system_prompt
        self.env: Any = None

    async def start(self, row: dict[str, Any]) -> Start:
        self.env = await _in_gem_thread(self.gem.make, self.env_id, **self.env_kwargs)
        observation, _ = await _in_gem_thread(self.env.reset, seed=row.get("seed"))
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return Start(messages=[*system, {"role": "user", "content": str(observation)}])

    async def step(self, turn: Turn) -> Step:
        observation, reward, terminated, truncated, info = await _in_gem_thread(self.env.step, turn.text)
        done = bool(terminated or truncated)
        messages = [] if done else [{"role": "user", "content": str(observation)}]
        return Step(messages=messages, reward=float(reward), done=done, metrics=numeric(info or {}))
