"""Several environments in one run: each row names its environment, and the data interleaves their sources.

    data:
      function: distrl.standards.mixture:rows
      kwargs:
        sources:
          arithmetic: {function: distrl.standards.reasoning_gym:rows, kwargs: {tasks: [basic_arithmetic]}}
          guess: {function: distrl.standards:seeds, kwargs: {count: 500}}
    env:
      class: distrl.standards.mixture:Mixture
      kwargs:
        envs:
          arithmetic: {class: distrl.agents.envs:ToolEnvironment,
                       kwargs: {tools: [], reward: distrl.standards.reasoning_gym:score}}
          guess: {class: distrl.standards.gem:GemEnv, kwargs: {env_id: "game:GuessTheNumber-v0-easy"}}

`rows` tags each source's rows with its name (under `key`) and interleaves them, one of each in turn while every
source lasts; `Mixture` plays each episode in the environment its row names. Figures are kept apart by
environment: an environment's own figure `x` is logged as `env/<name>/x`, and its episodes' rewards as
`env/<name>/reward` (verifiers' `EnvGroup` and prime-rl's multi-environment runs do the same).
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from distrl.agents.env import Environment, Start, Step, Turn, resolve_env
from distrl.imports import import_spec

KEY = "env"
"""The row's column naming its environment."""


def _part(spec: dict[str, Any], what: str, name: str, field: str) -> tuple[str, dict[str, Any]]:
    """(spec, kwargs) of one source or environment, written `{<field>: package.module:attr, kwargs: {...}}`."""
    unknown = set(spec) - {field, "kwargs"}
    if field not in spec or unknown:
        raise ValueError(f"{what} {name!r} must be {{{field}: package.module:name, kwargs: {{...}}}}, got {spec!r}")
    return spec[field], dict(spec.get("kwargs") or {})


def rows(sources: dict[str, dict[str, Any]], key: str = KEY) -> list[dict[str, Any]]:
    """The rows of every source (`{name: {function, kwargs}}`, each a data function as `data.function` takes
    it), each with its source's name under `key`, interleaved: row 0 of each source in turn, then row 1, ..."""
    if not sources:
        raise ValueError("sources names no source")
    made = []
    for name, spec in sources.items():
        function, kwargs = _part(spec, "source", name, "function")
        fn = import_spec(function, "data function", "function", "distrl.standards.reasoning_gym:rows")
        made.append([{**row, key: name} for row in fn(**kwargs)])
    return [source[i] for i in range(max(map(len, made))) for source in made if i < len(source)]


@cache
def _environment(spec: str) -> type:
    return resolve_env(spec)


class Mixture:
    """Plays each episode in the environment of `envs` (`{name: {class, kwargs}}`) that its row's `key` names."""

    def __init__(self, envs: dict[str, dict[str, Any]], key: str = KEY):
        if not envs:
            raise ValueError("envs names no environment")
        self.envs = {name: _part(spec, "environment", name, "class") for name, spec in envs.items()}
        self.key = key
        self.name = ""
        self.env: Environment | None = None
        self.reward = 0.0

    async def start(self, row: dict[str, Any]) -> Start:
        name = row.get(self.key)
        if name not in self.envs:
            raise ValueError(f"the row's {self.key!r} is {name!r}, not one of the mixture's environments "
                             f"{sorted(self.envs)}")
        spec, kwargs = self.envs[name]
        self.name, self.env = name, _environment(spec)(**kwargs)
        return await self.env.start(row)

    async def step(self, turn: Turn) -> Step:
        assert self.env is not None, "start comes first"
        step = await self.env.step(turn)
        if not isinstance(step, Step):
            return step  # the host reports a wrong return type, naming the mixture
        self.reward += step.reward or 0.0
        metrics = {f"{self.name}/{k}": v for k, v in step.metrics.items()}
        metrics[f"{self.name}/reward"] = self.reward  # the episode's reward so far: its last value is the total
        return dataclasses.replace(step, metrics=metrics)

    def close(self) -> None:
        close = getattr(self.env, "close", None)
        if close is not None:
            close()
