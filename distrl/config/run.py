"""`run`: steps, seed, outputs, logging and checkpoints."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from distrl.config.base import Section

# One plain path component: no separators, and no leading dot, so never `.`, `..` or a hidden directory.
RUN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


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
    tensorboard: bool = True
    """Write TensorBoard event files to RUN_DIR/tensorboard."""
    ray_metrics: bool = True
    """Export every step's figures as Ray metrics (dashboard metrics view)."""
    progress: bool = True
    """Show a progress bar."""
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
    metrics.jsonl, tensorboard/, checkpoints/; any other file stays). Without it (or `resume`), such a directory is
    an error, so two runs never mix their files. With `resume` as well, a directory that holds a checkpoint is
    resumed and only one without is started afresh (so `--set run.resume=true` continues the quickstart, which sets
    `overwrite`)."""

    @field_validator("name")
    @classmethod
    def _one_directory_name(cls, name: str) -> str:
        # The name is joined to output_dir and the result may be deleted from (run.overwrite): `..` or `a/b` would
        # point outside output_dir/.
        if not RUN_NAME.fullmatch(name):
            raise ValueError(f"run.name {name!r} must be one plain directory name: letters, digits, '_', '-' and "
                             f"'.', not starting with '.' or '-' (it names a directory inside output_dir)")
        return name
