"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption notice, `kill`, `ray job stop`).

The first signal asks the run to stop after the step in progress: that step finishes and is logged, the driver
checkpoints it, every actor and placement group is released, and `train` raises `Stopped`, which says how to resume.
A second signal stops at once (KeyboardInterrupt): the same clean-up runs, and the run resumes from its newest
checkpoint. Either way the run directory is consistent: a row is only ever written for a finished step.

The handlers replace Ray's (which exits the driver from inside a blocking call) while the run's loop is active and
are restored after it; signal handlers can only be set from the main thread, so elsewhere nothing is changed.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from types import FrameType, TracebackType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run stopped after a finished step because it was sent `signal_name`; `message` says how to resume."""

    def __init__(self, signal_name: str, exit_code: int, message: str):
        super().__init__(message)
        self.signal_name, self.exit_code = signal_name, exit_code


class StopOnSignal:
    """`with StopOnSignal() as stop: for step in stop.steps(range(...)): ...`: the loop ends after the step in
    progress once SIGINT or SIGTERM arrives; `stop.signal` is then its number."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopOnSignal:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} received twice: stopping at once")
        self.signal = signum
        print(f"\n{signal.Signals(signum).name}: stopping after the step in progress, then checkpointing it "
              f"(send it again to stop at once)", file=sys.stderr, flush=True)

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        """`steps`, until a signal has arrived (checked before each step starts)."""
        for step in steps:
            if self.signal is not None:
                return
            yield step
