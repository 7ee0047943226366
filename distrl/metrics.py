"""Metric sinks (JSONL, TensorBoard, Ray metrics) and the phase timer.

Every step's figures go to every sink: `RUN_DIR/metrics.jsonl` (one JSON object per step), TensorBoard event files
in `RUN_DIR/tensorboard`, and Ray gauges `distrl_<key>` (`/` as `_`, tagged with the run name; Prometheus sees them
as `ray_distrl_<key>`) for the Ray dashboard's metrics view. Values that were not measured this step are written as
null to JSONL and skipped elsewhere.
"""

from __future__ import annotations

import json
import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # ray is imported only when a RayMetricsSink writes
    from ray.util.metrics import Gauge


class Sink(ABC):
    @abstractmethod
    def write(self, step: int, metrics: dict[str, float | None]) -> None: ...

    def text(self, step: int, tag: str, markdown: str) -> None:  # noqa: B027 - most sinks keep figures only
        """Record text a person reads (training samples) under `tag` at `step`."""

    def close(self) -> None:  # noqa: B027 - deliberately a no-op by default: a sink may hold no files
        """Flush and release files."""


class JsonlSink(Sink):
    def __init__(self, path: Path):
        self.path = path
        self.file = path.open("a", buffering=1)

    def write(self, step: int, metrics: dict[str, float | None]) -> None:
        # A non-finite figure is written as it was (NaN, Infinity, -Infinity: what Python's json and pandas read
        # back as floats), not as null, which means "not measured": a skipped step must show its loss and norm.
        self.file.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")

    def close(self) -> None:
        self.file.close()


class TensorBoardSink(Sink):
    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory))

    def write(self, step: int, metrics: dict[str, float | None]) -> None:
        for key, value in metrics.items():
            if value is not None:
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def text(self, step: int, tag: str, markdown: str) -> None:
        self.writer.add_text(tag, markdown, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def gauge_name(key: str) -> str:
    """The Ray gauge of metric `key`: `reward/mean` -> `distrl_reward_mean` (Prometheus: `ray_distrl_reward_mean`)."""
    return "distrl_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class RayMetricsSink(Sink):
    """One `ray.util.metrics.Gauge` per key, created on first sight."""

    def __init__(self, run_name: str):
        self.tags = {"run": run_name}
        self.gauges: dict[str, Gauge] = {}

    def write(self, step: int, metrics: dict[str, float | None]) -> None:
        from ray.util.metrics import Gauge

        for key, value in {"step": float(step), **metrics}.items():
            if value is None or not math.isfinite(value):
                continue
            if key not in self.gauges:
                self.gauges[key] = Gauge(gauge_name(key), description=f"distrl {key}", tag_keys=("run",))
            self.gauges[key].set(value, tags=self.tags)


class MetricsLogger:
    """Fans one step's metrics out to every sink."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        for sink in self.sinks:
            sink.write(step, metrics)

    def text(self, step: int, tag: str, markdown: str) -> None:
        for sink in self.sinks:
            sink.text(step, tag, markdown)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


class PhaseTimer:
    """`with timer("generate"): ...` records `time/generate` in seconds; `pop()` returns and clears them."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{phase}"] = self.times.get(f"time/{phase}", 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        times, self.times = self.times, {}
        return times


class BusyClock:
    """How much of the time between two rows a role spent working: each call counts from when it was started
    to when the driver saw it done (calls of one role run one after another)."""

    def __init__(self) -> None:
        self._period = time.perf_counter()
        self._since: float | None = None
        self._busy = 0.0

    def start(self) -> None:
        if self._since is None:
            self._since = time.perf_counter()

    def stop(self) -> None:
        if self._since is not None:
            self._busy += time.perf_counter() - self._since
            self._since = None

    def pop_idle(self) -> float:
        """Fraction of the time since the last call that the role was idle; starts a new period."""
        now = time.perf_counter()
        busy = self._busy + (now - self._since if self._since is not None else 0.0)
        span, self._period, self._busy = now - self._period, now, 0.0
        if self._since is not None:
            self._since = now
        return max(0.0, 1.0 - busy / span) if span > 0 else 0.0
