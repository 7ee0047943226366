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
episode's, and the event loop keeps serving the other episodes meanwhile. A call that hangs ends its episode at
`env.step_timeout_s`; the thread stuck in it is abandoned, and the calls after it (those already waiting included)
run on a new one, so that one hung game does not stop every later episode. (Should the abandoned call ever return,
what it drew from the global generators was drawn beside the new thread's calls.)
"""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from distrl.agents.env import Start, Step, Turn
from distrl.standards import numeric, require

log = logging.getLogger(__name__)

_Call = tuple[Callable[[], Any], "Future[Any]"]


class _Worker:
    """A daemon thread that runs the calls put in `calls` one at a time, in order, each result (or exception)
    handed over through its future; None stops it. Daemon: a call that never returns does not keep the process
    from exiting."""

    def __init__(self) -> None:
        self.calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.abandoned = False
        threading.Thread(target=self._run, name="gem", daemon=True).start()

    def _run(self) -> None:
        while not self.abandoned:
            call = self.calls.get()
            if call is None:
                return
            fn, future = call
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # noqa: BLE001 - the call's failure is its caller's: raised there
                    future.set_exception(err)


class _GemThread:
    """The process's gem thread: one worker at a time, replaced when a call hangs."""

    def __init__(self) -> None:
        self.worker = _Worker()
        self.replacing = threading.Lock()
        """Held while the worker is replaced, and while a call is queued."""

    def submit(self, fn: Callable[[], Any]) -> tuple[_Worker, Future[Any]]:
        """Queue `fn`; (the worker it was given to, its future)."""
        future: Future[Any] = Future()
        with self.replacing:  # never into a worker being abandoned, after its calls were moved
            worker = self.worker
            worker.calls.put((fn, future))
        return worker, future

    def abandon(self, stuck: _Worker) -> None:
        """Give the calls waiting behind `stuck`'s hung call, and all later ones, to a new worker."""
        with self.replacing:
            if self.worker is not stuck:  # another episode's time-out replaced it already
                return
            self.worker = _Worker()
            stuck.abandoned = True
            while True:
                try:
                    call = stuck.calls.get_nowait()
                except queue.Empty:
                    break
                if call is not None:
                    self.worker.calls.put(call)
            stuck.calls.put(None)


_GEM = _GemThread()


async def _in_gem_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    worker, future = _GEM.submit(functools.partial(fn, *args, **kwargs))
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:  # the episode's time limit (or its end): a call still running is stuck
        if future.running():
            _GEM.abandon(worker)
        raise


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

    def close(self) -> None:
        """Close the environment if it has a `close` (gem's tool environments hold sandboxes and servers; its games
        need none) on the gem thread, after its calls, without waiting; a failure is logged (close must not
        raise)."""
        close = getattr(self.env, "close", None)
        self.env = None
        if close is None:
            return
        _, future = _GEM.submit(close)
        future.add_done_callback(functools.partial(_report_close, self.env_id))


def _report_close(env_id: str, future: Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("closing gem environment %s failed: %s: %s", env_id, type(future.exception()).__name__,
                    future.exception())
