"""Experiment trackers (`run.trackers`: `wandb`, `mlflow`): the run kept in a service outside the run directory.

Only the driver logs to them, after each step's row is in RUN_DIR/metrics.jsonl. Each tracker's run id is kept in
RUN_DIR/trackers.json, so a resumed run continues the same tracker run. A tracker that fails to start stops the run
before its cluster starts (the user asked for it); one that fails mid-run is named in one warning and dropped for
the rest of the run, and training goes on. The tracker packages are imported only when a tracker starts, so
`distrl validate` stays light.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

from distrl.config import Config
from distrl.trackers.base import EndState, Tracker
from distrl.trackers.mlflow import MlflowTracker
from distrl.trackers.wandb import WandbTracker

IDS = "trackers.json"
"""RUN_DIR/trackers.json: {tracker name: its run id}."""
TRACKERS: dict[str, Callable[[Config, Path], Tracker]] = {
    "wandb": lambda cfg, run_dir: WandbTracker(cfg.run.wandb, cfg.run.name, run_dir),
    "mlflow": lambda cfg, run_dir: MlflowTracker(cfg.run.mlflow, cfg.run.name),
}
"""The entries of `run.trackers` that are trackers (`jsonl` and `tensorboard` are files in RUN_DIR)."""


class TrackerError(RuntimeError):
    """A tracker could not start its run."""


class Trackers:
    """The run's live trackers: every row goes to each; one that raises is named in a warning and dropped."""

    def __init__(self, trackers: list[Tracker] | None = None):
        self.live = list(trackers or [])

    def start(self, cfg: Config, run_dir: Path, resumed: bool) -> None:
        """Start every tracker of `cfg.run.trackers` with the resolved config, continuing the runs named in
        RUN_DIR/trackers.json when `resumed`. Raises TrackerError naming the first that fails; those started
        before it stay live, so that the run's end marks them."""
        path = run_dir / IDS
        ids: dict[str, str] = json.loads(path.read_text()) if resumed and path.is_file() else {}
        config = cfg.model_dump(mode="json", by_alias=True)
        for name in cfg.run.trackers:
            if name not in TRACKERS:
                continue
            tracker = TRACKERS[name](cfg, run_dir)
            try:
                ids[name] = tracker.start(config, ids.get(name))
            except ImportError as err:
                raise TrackerError(f"run.trackers lists {name}, but {name} cannot be imported ({err}): install it "
                                   f"with pip install 'distrl[trackers]'") from err
            except Exception as err:
                raise TrackerError(f"run.trackers: {name} could not start its run: {type(err).__name__}: {err}") \
                    from err
            self.live.append(tracker)
        if self.live:
            path.write_text(json.dumps(ids, indent=1) + "\n")

    def log(self, step: int, row: dict[str, float | None]) -> None:
        for tracker in list(self.live):
            try:
                tracker.log(step, row)
            except Exception as err:  # noqa: BLE001 - a tracker must never stop training (it is named and dropped)
                self._drop(tracker, f"failed to log step {step}", err)

    def finish(self, state: EndState) -> None:
        for tracker in list(self.live):
            try:
                tracker.finish(state)
            except Exception as err:  # noqa: BLE001 - the run's own end (and its error, if any) comes first
                self._drop(tracker, f"failed to mark the run {state}", err)
        self.live.clear()

    def _drop(self, tracker: Tracker, what: str, err: Exception) -> None:
        self.live.remove(tracker)
        warnings.warn(f"run.trackers: {tracker.name} {what} and is disabled for the rest of this run (training goes "
                      f"on): {type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)
