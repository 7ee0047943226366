"""Weights & Biases: one W&B run per distrl run, its files under RUN_DIR/wandb.

Every row is logged with its step as the key `step`, which every other key is plotted against
(`define_metric("*", step_metric="step")`), rather than as W&B's own `_step`: W&B drops a row whose `_step` is below
one it has seen, and a resumed run logs the steps after its checkpoint again. The end state is the summary's
`end_state`; W&B shows a finished run as finished and a failed or stopped one as failed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from distrl.config import WandbConfig
from distrl.trackers.base import EndState, Tracker


class WandbTracker(Tracker):
    name = "wandb"

    def __init__(self, settings: WandbConfig, run_name: str, run_dir: Path):
        self.settings, self.run_name, self.run_dir = settings, run_name, run_dir

    def start(self, config: dict[str, Any], run_id: str | None) -> str:
        import wandb

        self.run = wandb.init(project=self.settings.project, entity=self.settings.entity, name=self.run_name,
                              tags=self.settings.tags, mode=self.settings.mode, dir=self.run_dir, id=run_id,
                              resume="allow" if run_id else None)
        # A resumed run's config may differ (more steps): record the one it continues with.
        self.run.config.update(config, allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        return self.run.id

    def log(self, step: int, row: dict[str, float | None]) -> None:
        self.run.log({"step": step, **{k: v for k, v in row.items() if v is not None}})

    def finish(self, state: EndState) -> None:
        self.run.summary["end_state"] = state
        self.run.finish(exit_code=0 if state == "finished" else 1)
