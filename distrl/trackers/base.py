"""The seam every tracker fills: a service outside the run directory that keeps a run of its own.

Beside the sinks of `distrl.metrics` (files in RUN_DIR and Ray gauges, which only write), a tracker also opens a run
with the resolved config, continues it by id when the run is resumed, and closes it with the run's end state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Literal

EndState = Literal["finished", "failed", "stopped"]
"""How a run ended: every step trained, an error, or a signal (SIGINT, SIGTERM) that stopped it after a step."""


class Tracker(ABC):
    name: ClassVar[str]
    """The name in `run.trackers` (and in RUN_DIR/trackers.json)."""

    @abstractmethod
    def start(self, config: dict[str, Any], run_id: str | None) -> str:
        """Open the tracker's run and record `config` (the resolved config as plain data): a new run, or the run
        `run_id` when continuing one. Returns the run's id, which RUN_DIR/trackers.json keeps for a resume."""

    @abstractmethod
    def log(self, step: int, row: dict[str, float | None]) -> None:
        """Record the figures of `row` (every key; None: not measured this step) at x = `step`."""

    @abstractmethod
    def finish(self, state: EndState) -> None:
        """Close the run, marking how it ended."""
