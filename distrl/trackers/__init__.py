"""Experiment trackers (`run.trackers`: `wandb`, `mlflow`): the run kept in a service outside the run directory.

Only the driver logs to them, after each step's row is in RUN_DIR/metrics.jsonl, and each tracker's rows are sent
by a thread of its own (`Sender`), so training never waits for a service. Each tracker's run id is kept in
RUN_DIR/trackers.json, so a resumed run continues the same tracker run. A tracker that fails to start stops the run
before its cluster starts (the user asked for it); one that fails mid-run is named in one warning (at the next step,
or at the run's end) and dropped for the rest of the run, and training goes on. At the end each tracker gets up to
FINISH_S seconds to send what is queued before its run is marked. The tracker packages are imported only when a
tracker starts, so `distrl validate` stays light.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

from distrl.config import Config
from distrl.trackers.base import EndState, Tracker
from distrl.trackers.mlflow import MlflowTracker
from distrl.trackers.sender import Sender
from distrl.trackers.wandb import WandbTracker

IDS = "trackers.json"
"""RUN_DIR/trackers.json: {tracker name: its run id}."""
TRACKERS: dict[str, Callable[[Config, Path], Tracker]] = {
    "wandb": lambda cfg, run_dir: WandbTracker(cfg.run.wandb, cfg.run.name, run_dir),
    "mlflow": lambda cfg, run_dir: MlflowTracker(cfg.run.mlflow, cfg.run.name),
}
"""The entries of `run.trackers` that are trackers (`jsonl` and `tensorboard` are files in RUN_DIR)."""
FINISH_S = 120.0
"""How long the run's end waits for a tracker to send its queued rows."""


class TrackerError(RuntimeError):
    """A tracker could not start its run."""


class Trackers:
    """The run's live trackers, each behind its Sender: every row is queued for each; one whose log raised is named
    in a warning and dropped."""

    def __init__(self, trackers: list[Tracker] | None = None):
        self.live = [Sender(tracker) for tracker in trackers or []]

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
            self.live.append(Sender(tracker))
        if self.live:
            path.write_text(json.dumps(ids, indent=1) + "\n")

    def log(self, step: int, row: dict[str, float | None]) -> None:
        for sender in list(self.live):
            if sender.failure is None:
                sender.send(step, row)
            else:
                self._drop(sender, *sender.failure)

    def finish(self, state: EndState) -> None:
        """Send what is queued, then mark each tracker's run `state`."""
        for sender in list(self.live):
            if not sender.stop(FINISH_S):
                self.live.remove(sender)
                warnings.warn(f"run.trackers: {sender.tracker.name} was still sending rows {FINISH_S:.0f} s after "
                              f"the run ended; its run is left unmarked", RuntimeWarning, stacklevel=2)
            elif sender.failure is not None:
                self._drop(sender, *sender.failure)
            else:
                try:
                    sender.tracker.finish(state)
                except Exception as err:  # noqa: BLE001 - the run's own end (and its error, if any) comes first
                    self._drop(sender, None, err)
        self.live.clear()

    def _drop(self, sender: Sender, step: int | None, err: Exception) -> None:
        self.live.remove(sender)
        what = f"failed to log step {step}" if step is not None else "failed to mark its run's end"
        warnings.warn(f"run.trackers: {sender.tracker.name} {what} and is disabled for the rest of this run "
                      f"(training goes on): {type(err).__name__}: {err}", RuntimeWarning, stacklevel=3)
