"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (`kill`, a scheduler's notice before it preempts).

The first signal asks the run to stop after the step in progress: that step finishes and is logged, the driver
checkpoints it, every actor and placement group is released, and `train` raises `Stopped`, which says how to resume.
During start-up the run stops as soon as the phase in progress ends. A second signal stops at once
(`StopNow`, a KeyboardInterrupt): the same clean-up runs, and the run resumes from its newest checkpoint. Either way
the run directory is consistent: a row is only ever written for a finished step.

The handlers are installed from the start of `train` until after the cluster is shut down, and taken back after
`ray.init`, which installs its own SIGTERM handler (one that exits the driver from inside a blocking call). Signal
handlers can only be set from the main thread; elsewhere nothing is changed. Signal only the driver: a scheduler
that signals the whole process group stops Ray's workers mid-step too, and `ray job stop` sends SIGKILL
`RAY_JOB_STOP_WAIT_TIME_S` (3 by default) seconds after SIGTERM, so raise it to let the step finish.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable, Iterator
from types import FrameType, TracebackType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(Exception):
    """The run stopped after a finished step (or during start-up) because it was sent `signal_name`; the message
    says how to resume."""

    def __init__(self, signal_name: str, exit_code: int, message: str):
        super().__init__(message)
        self.signal_name, self.exit_code = signal_name, exit_code


class StopNow(KeyboardInterrupt):
    """A second signal: stop at once. `exit_code` is 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"{signal.Signals(signum).name} received twice: stopping at once")
        self.exit_code = 128 + signum


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

    def take_back(self) -> None:
        """Handle the signals again after a library (ray.init) replaced the handlers."""
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal is not None:
            raise StopNow(signum)
        self.signal = signum
        # os.write, not print: the handler may run while the main thread is inside a write to stderr (tqdm), and a
        # buffered writer re-entered from a signal handler raises.
        os.write(2, f"\n{signal.Signals(signum).name}: stopping after the step in progress, then checkpointing it "
                    f"(send it again to stop at once)\n".encode())

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signal).name if self.signal is not None else ""

    def check(self, during: str) -> None:
        """Raise `Stopped` if a signal arrived during `during` (a start-up phase: no step has run)."""
        if self.signal is not None:
            raise Stopped(self.signal_name, 128 + self.signal,
                          f"stopped by {self.signal_name} during {during}, before any step of this run; every actor "
                          f"was released")

    def steps(self, steps: Iterable[int]) -> Iterator[int]:
        """`steps`, until a signal has arrived (checked before each step starts)."""
        for step in steps:
            if self.signal is not None:
                return
            yield step
