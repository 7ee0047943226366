"""Agents distrl did not write: an async function that plays one episode against an OpenAI-compatible client and
returns its reward, named in the config as `env.agent: package.module:function` (with `env.kwargs`):

    async def agent(client: openai.AsyncOpenAI, row: dict, **kwargs) -> float

`client` points at the rollout worker's endpoint for this episode (`distrl.agents.server`): every chat completion
the agent asks for is sampled by the policy, and distrl keeps the token ids and log-probs of each
(`distrl.agents.calls`). The agent may call tools, branch, rewrite its history, or use a framework (LangGraph,
the OpenAI Agents SDK) given `client` or its `base_url`; distrl trains on what the model sampled. `AgentHost` runs
the functions of many episodes at once, in an environment actor (`cluster.env`) like environments.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
import traceback
from collections.abc import Callable
from typing import Any, Literal

from distrl.agents.host import EnvError, EnvFailed, EnvHost, EnvTimeout, failing_line
from distrl.config import EnvConfig
from distrl.imports import import_spec

API_KEY = "distrl"
"""What the client sends as its key (the endpoint listens on the cluster's own network and checks none)."""


def resolve_agent(spec: str) -> Callable[..., Any]:
    """The agent function that `spec` (`package.module:function`) names, checked to be a coroutine function
    taking a client and a row."""
    fn = import_spec(spec, "agent", "function", "my_package.agents:solve")
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent {spec!r} must be an 'async def' function: async def agent(client, row, **kwargs) "
                         f"-> float")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as err:
        raise ValueError(f"agent {spec!r} must take (client, row) as its first two arguments: {err}") from err
    return fn


class AgentHost:
    """Runs agent function `spec` (with `kwargs`) for many episodes at once; each episode within `timeout_s`."""

    def __init__(self, spec: str, kwargs: dict[str, Any], timeout_s: float, on_error: Literal["raise", "zero"]):
        self.spec, self.kwargs, self.timeout, self.on_error = spec, dict(kwargs), timeout_s, on_error
        self.fn = resolve_agent(spec)

    async def run(self, episode: str, row: dict[str, Any], base_url: str) -> float:
        """Play episode `episode` on dataset row `row` against the endpoint at `base_url`; its reward."""
        import openai

        began = time.perf_counter()
        async with openai.AsyncOpenAI(base_url=base_url, api_key=API_KEY, max_retries=0,
                                      timeout=self.timeout) as client:
            try:
                reward = await asyncio.wait_for(self.fn(client, row, **self.kwargs), self.timeout)
            except TimeoutError as err:
                raise EnvTimeout(f"agent {self.spec} did not finish episode {episode} within env.agent_timeout_s "
                                 f"= {self.timeout:g} s ({time.perf_counter() - began:.1f} s)") from err
            except Exception as err:
                raise self._failure(err, episode) from err
        if not isinstance(reward, int | float) or not math.isfinite(reward):  # bool is an int: True scores 1
            raise self._failure(TypeError(f"returned {reward!r}, expected a finite float reward"), episode)
        return float(reward)

    def end(self, episode: str) -> None:
        """Nothing is kept between an episode's calls (the same interface as `EnvHost`)."""

    def _failure(self, err: BaseException, episode: str) -> EnvError | EnvFailed:
        where = self._line(err) if err.__traceback__ is not None else "its return value"
        message = f"agent {self.spec} failed in episode {episode}: {type(err).__name__}: {err} (at {where})"
        if self.on_error == "raise":
            return EnvError(message + "; env.on_error: zero scores such episodes 0 and counts them instead")
        return EnvFailed(message)

    def _line(self, err: BaseException) -> str:
        """The agent's own line that the failure passed through last (not the OpenAI client's, where an error
        answer is raised), else the innermost."""
        source = inspect.getsourcefile(self.fn)
        mine = [f for f in traceback.extract_tb(err.__traceback__) if f.filename == source]
        if not mine:
            return failing_line(err)
        f = mine[-1]
        return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


def host_of(env: EnvConfig) -> tuple[type, tuple]:
    """The class that hosts `env`'s episodes (`AgentHost` for `env.agent`, `EnvHost` for `env.class`) and the
    arguments it is built with."""
    if env.agent is not None:
        return AgentHost, (env.agent, env.kwargs, env.agent_timeout_s, env.on_error)
    assert env.cls is not None
    return EnvHost, (env.cls, env.kwargs, env.step_timeout_s, env.on_error)
