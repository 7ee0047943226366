"""`EngineLoop`: the thread that owns a rollout worker's vLLM engine.

The engine is built on this thread, and every operation on it runs here, one at a time in the order submitted:
the episodes of every generation call in flight (asyncio tasks sharing one `EngineStepper`), weight loads,
fingerprint checks and scoring. The stepper yields after each engine step, so an operation submitted while episodes
run takes its turn between two steps: a weight load lands between steps, and from the next step on every token is
sampled, and stamped, by the new version. The caller's thread (a Ray actor thread, or the driver's with the local
backend) only submits and waits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")


class EngineLoop:
    """Builds the engine with `build()` on a thread of its own and runs an event loop there until `stop()`."""

    def __init__(self, build: Callable[[], Any]):
        self.loop = asyncio.new_event_loop()
        built: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._serve, args=(build, built), name="distrl-engine", daemon=True)
        self._thread.start()
        self.engine = built.result()  # the build's own exception, if it failed
        self.on_failure: Callable[[BaseException], None] | None = None
        """Called with the exception of an operation that failed, before it is raised in the caller's thread (a
        tensor-parallel engine whose worker died ends its process there: `RolloutWorker._watch_workers`)."""

    def _serve(self, build: Callable[[], Any], built: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            built.set_result(build())
        except BaseException as err:  # noqa: BLE001 - raised again by the constructor, in the caller's thread
            built.set_exception(err)
            self.loop.close()
            return
        self.loop.run_forever()
        self.loop.close()

    def run(self, coroutine: Awaitable[T]) -> T:
        """Run `coroutine` on the engine's loop; wait for its result here."""
        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()  # type: ignore[arg-type]
        except BaseException as err:
            if self.on_failure is not None:
                self.on_failure(err)
            raise

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run `fn(*args, **kwargs)` on the engine's thread, between two engine steps; wait for its result here."""
        async def between_steps() -> T:
            return fn(*args, **kwargs)

        return self.run(between_steps())

    def start(self, coroutine: Awaitable[Any]) -> None:
        """Run `coroutine` on the engine's loop in the background (the stepper's loop)."""
        self.loop.call_soon_threadsafe(lambda: self.loop.create_task(coroutine))  # type: ignore[arg-type]

    def stop(self, wait_s: float = 0.0) -> None:
        """End the loop (the engine is released with the thread); wait up to `wait_s` for the thread to end (not
        when called on it, as a collection there may)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        if wait_s and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)
