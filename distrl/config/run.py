"""`run`: steps, seed, outputs, logging and checkpoints."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from distrl.config.base import Section
from distrl.config.collapse import RewardCollapseConfig
from distrl.config.correction_alarm import CorrectionAlarmConfig
from distrl.config.trackers import MlflowConfig, WandbConfig

# One plain path component: no separators, and no leading dot, so never `.`, `..` or a hidden directory.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
Tracker = Literal["jsonl", "tensorboard", "wandb", "mlflow"]
DEFAULT_TRACKERS: list[Tracker] = ["jsonl", "tensorboard"]


class RunConfig(Section):
    name: str = "run"
    """Run name: the run directory is output_dir/name. One plain directory name: letters, digits, `_`, `-` and `.`,
    not starting with `.` or `-`."""
    output_dir: str = "runs"
    """Parent of run directories."""
    steps: int = Field(default=10, gt=0)
    """Training steps (one step = generate, score, update, sync)."""
    seed: int = 0
    """Seed of data order, sampling and initialisation."""
    log_every: int = Field(default=1, gt=0)
    """Print a progress line every this many steps (metrics files get every step)."""
    trackers: list[Tracker] = Field(default_factory=lambda: list(DEFAULT_TRACKERS))
    """Where every step's row goes (the resolved config and the run's end state too, where the tracker keeps a
    run): `jsonl` (RUN_DIR/metrics.jsonl; required, since resuming reads it), `tensorboard` (RUN_DIR/tensorboard),
    `wandb` (Weights & Biases, set up by `run.wandb`), `mlflow` (set up by `run.mlflow`). The older
    `run.tensorboard: true|false` is still read: it adds `tensorboard` to this list or takes it out."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """The W&B project, entity, tags and mode, when `run.trackers` lists `wandb`."""
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """The MLflow tracking server, experiment and tags, when `run.trackers` lists `mlflow`."""
    samples_every: int = Field(default=10, ge=0)
    """Every this many steps, write a few of the step's training samples (prompt, completion, reward, advantage)
    to RUN_DIR/samples/step_<N>.jsonl and to TensorBoard's text tab, for a person to read; 0: never."""
    samples_per_write: int = Field(default=4, gt=0)
    """How many samples each such write holds (the step's first episodes)."""
    reward_collapse: RewardCollapseConfig | None = Field(default_factory=RewardCollapseConfig)
    """Warn, in the log and in every row's `health/reward_collapsed`, when the mean reward has fallen to a fraction
    of its best and stayed there (a learning rate too large for the model, a reward hacked and then lost): the run
    goes on, since only its owner can tell a collapse from a task that got harder. null: no watch."""
    correction_alarm: CorrectionAlarmConfig | None = Field(default_factory=CorrectionAlarmConfig)
    """Warn once, in the log, and count in every row's `health/correction_ess_low` and
    `health/correction_truncated_high`, when the IS weights of the tokens of some staleness have a low effective
    sample size or many truncated (masked) weights, `steps` steps in a row: the correction no longer corrects, and
    the warning says what to change (docs/correction.md). Watches only a run with a `loss.correction`. null: no
    watch."""
    ray_metrics: bool = True
    """Export every step's figures as Ray metrics (dashboard metrics view)."""
    progress: bool = True
    """Show a progress bar."""
    library_logs: Literal["file", "console"] = "file"
    """Where the output of the libraries inside the actors goes (vLLM's, Ray's, torch's and transformers' warnings
    and notices, and whatever a reward function prints): `file`, RUN_DIR/libraries.log, whose path the run prints
    (the console keeps distrl's lines, the progress bar and Ray's own word about its workers and nodes); `console`,
    the console as well (`distrl train --verbose`). Ray keeps its own copy either way (the dashboard's logs)."""
    checkpoint_every: int = Field(default=0, ge=0)
    """Save a checkpoint every this many steps (0: only at the end if `checkpoint_at_end`)."""
    checkpoint_at_end: bool = True
    """Save a checkpoint after the last step, so that a finished run can be continued (`resume` with more
    `steps`) or its policy used."""
    keep_checkpoints: int | None = Field(default=None, ge=1)
    """Keep only the newest this many checkpoints (null keeps every one). Each save deletes the older ones after
    the new one is complete, so a resume always has one to fall back to."""
    resume: bool = False
    """Continue from the newest usable checkpoint in the run directory (metrics after its step are dropped; a newer
    checkpoint that fails its manifest check is named and skipped). With no checkpoint there, the run starts at
    step 1."""
    overwrite: bool = False
    """Start afresh in a run directory that already holds a run, deleting what distrl wrote there (config.yaml,
    metrics.jsonl, tensorboard/, checkpoints/, trackers.json, wandb/, eval/, samples/; any other file stays).
    Without it (or `resume`), such a directory is an error, so two runs never mix their files. With `resume` as
    well, a directory that holds a checkpoint is resumed and only one without is started afresh (so `--set
    run.resume=true` continues the quickstart, which sets `overwrite`)."""

    @property
    def tensorboard(self) -> bool:
        """Whether TensorBoard event files are written to RUN_DIR/tensorboard."""
        return "tensorboard" in self.trackers

    @model_validator(mode="before")
    @classmethod
    def _tensorboard_alias(cls, data: Any) -> Any:
        # `run.tensorboard` predates `run.trackers` and is in users' configs and commands (`--set
        # run.tensorboard=false`): it adds `tensorboard` to the list (true) or takes it out (false).
        if not isinstance(data, dict) or "tensorboard" not in data:
            return data
        data = dict(data)
        tensorboard = data.pop("tensorboard")
        if not isinstance(tensorboard, bool):
            raise ValueError(f"run.tensorboard must be true or false, got {tensorboard!r} (or list the trackers "
                             f"in run.trackers)")
        trackers = data.get("trackers", DEFAULT_TRACKERS)
        if isinstance(trackers, list):  # anything else is for the field's own validation to report
            data["trackers"] = [t for t in trackers if t != "tensorboard"] + (["tensorboard"] if tensorboard else [])
        return data

    @model_validator(mode="after")
    def _trackers(self) -> RunConfig:
        if "jsonl" not in self.trackers:
            raise ValueError(f"run.trackers: {self.trackers} must list jsonl: RUN_DIR/metrics.jsonl is what resuming "
                             f"and the run directory's checks read")
        repeated = sorted({t for t in self.trackers if self.trackers.count(t) > 1})
        if repeated:
            raise ValueError(f"run.trackers lists {', '.join(repeated)} more than once")
        for name, default in (("wandb", WandbConfig()), ("mlflow", MlflowConfig())):
            if getattr(self, name) != default and name not in self.trackers:
                raise ValueError(f"run.{name} is set but run.trackers does not list {name}: add it, e.g. "
                                 f"run.trackers: [{', '.join([*self.trackers, name])}]")
        return self

    @field_validator("name")
    @classmethod
    def _one_directory_name(cls, name: str) -> str:
        # The name is joined to output_dir and the result may be deleted from (run.overwrite): `..` or `a/b` would
        # point outside output_dir/.
        if not RUN_NAME.fullmatch(name):
            raise ValueError(f"run.name {name!r} must be one plain directory name: letters, digits, '_', '-' and "
                             f"'.', not starting with '.' or '-' (it names a directory inside output_dir)")
        return name
