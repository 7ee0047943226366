"""`EnvHost`: the environments of many episodes at once in one process, with the per-step time limit and what an
environment's exception does (`env.on_error`).

An environment actor holds one host; with `cluster.backend: local` the rollout worker holds one itself. Each
episode has its own environment instance, keyed by an episode id the caller chooses, dropped when the episode ends.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import Awaitable
from typing import Any, Literal, TypeVar

from distrl.agents.env import Environment, Start, Step, Turn, resolve_env

T = TypeVar("T")


class EnvError(RuntimeError):
    """An environment raised, or answered with something other than its protocol's types (`env.on_error:
    raise`): the run ends with this message, which names the class, the episode and the failing line."""


class EnvFailed(RuntimeError):
    """The same failure under `env.on_error: zero`: the episode ends with reward 0 and is counted."""


class EnvLost(RuntimeError):
    """The process hosting an episode's environment died: the episode is started again from its first turn (on
    the host that replaced it), at most `restarts` times."""


class EnvTimeout(RuntimeError):
    """A start or step that did not return within `env.step_timeout_s`: the episode ends with that reason."""


def failing_line(err: BaseException) -> str:
    """`file:line in function: code` of the innermost frame of `err`'s traceback (the user's line that raised)."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return "no traceback"
    f = frames[-1]
    return f"{f.filename}:{f.lineno} in {f.name}: {(f.line or '').strip()}"


class EnvHost:
    """Environments of class `spec` (`package.module:Class`, built with `kwargs`), one per episode."""

    def __init__(self, spec: str, kwargs: dict[str, Any], step_timeout_s: float,
                 on_error: Literal["raise", "zero"]):
        self.spec, self.kwargs, self.timeout, self.on_error = spec, dict(kwargs), step_timeout_s, on_error
        self.cls = resolve_env(spec)
        self.envs: dict[str, Environment] = {}

    async def start(self, episode: str, row: dict[str, Any]) -> Start:
        """Build episode `episode`'s environment and start it on dataset row `row`."""
        try:
            env = self.cls(**self.kwargs)
        except Exception as err:
            raise self._failure(err, episode, "__init__") from err
        self.envs[episode] = env
        return await self._call(env.start(row), episode, "start", Start)

    async def step(self, episode: str, turn: Turn) -> Step:
        """Episode `episode`'s environment's answer to `turn`."""
        env = self.envs.get(episode)
        if env is None:  # this host was started again since the episode began: its environment went with the old
            raise EnvLost(f"the host of episode {episode}'s environment was restarted since the episode began")
        return await self._call(env.step(turn), episode, "step", Step)

    def end(self, episode: str) -> None:
        """Drop episode `episode`'s environment (it may never have started), calling its `close()` if it has one:
        an environment that holds a connection, a session on a server or a task of its own releases it there,
        however the episode ended (done, cut by a budget, timed out, failed)."""
        env = self.envs.pop(episode, None)
        close = getattr(env, "close", None)
        if close is not None:
            close()

    async def _call(self, call: Awaitable[T], episode: str, method: str, expected: type) -> T:
        began = time.perf_counter()
        try:
            result = await asyncio.wait_for(call, self.timeout)
        except TimeoutError as err:
            self.end(episode)
            raise EnvTimeout(f"{self.spec}.{method} of episode {episode} did not return within env.step_timeout_s "
                             f"= {self.timeout:g} s ({time.perf_counter() - began:.1f} s)") from err
        except Exception as err:
            self.end(episode)
            raise self._failure(err, episode, method) from err
        if not isinstance(result, expected):
            self.end(episode)
            problem = TypeError(f"returned {type(result).__name__}, expected distrl.agents.env.{expected.__name__}")
            raise self._failure(problem, episode, method)
        return result

    def _failure(self, err: BaseException, episode: str, method: str) -> EnvError | EnvFailed:
        where = failing_line(err) if err.__traceback__ is not None else "its return value"
        message = (f"environment {self.spec}.{method} failed in episode {episode}: {type(err).__name__}: {err} "
                   f"(at {where})")
        if self.on_error == "raise":
            return EnvError(message + "; env.on_error: zero scores such episodes 0 and counts them instead")
        return EnvFailed(message)
