"""Nothing the producer waits for is waited for without a bound: each handle it waits on (a generation chunk, a
reward task, a learner's call, an engine's first weights) gets a time by which it must be done and the words that
name it if it is not, and a wait that passes one ends the run with them."""

from __future__ import annotations

from typing import Any

from distrl.cluster.backend import Backend


class Deadlines:
    """Handle -> (time.perf_counter() deadline, the error's message) for the handles waited on through `backend`."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.table: dict[Any, tuple[float, str]] = {}

    def set(self, handle: Any, deadline: float, message: str) -> None:
        self.table[handle] = (deadline, message)

    def pop(self, handle: Any) -> None:
        self.table.pop(handle, None)

    def until_first(self, waiting: list[Any], now: float) -> float | None:
        """Seconds from `now` until the earliest deadline among `waiting` (0 if one has passed; None: none)."""
        due = [self.table[h][0] for h in waiting if h in self.table]
        return max(0.0, min(due) - now) if due else None

    def raise_if_late(self, waiting: list[Any], done: list[Any], now: float) -> None:
        """A handle past its deadline at `now` that is still not done is late. (One done in time but not yet
        collected, because the driver was busy elsewhere or a wait returns one handle at a time, is not.)"""
        for h in waiting:
            if h in self.table and self.table[h][0] <= now and not any(h is d for d in done):
                ready, _ = self.backend.wait([h], timeout=0)
                if not ready:
                    raise TimeoutError(self.table[h][1])
