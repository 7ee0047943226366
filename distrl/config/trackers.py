"""`run.wandb` and `run.mlflow`: where the trackers that keep a run outside the run directory put it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distrl.config.base import Section


class WandbConfig(Section):
    project: str = "distrl"
    """Weights & Biases project the run is logged to (created on first use)."""
    entity: str | None = None
    """W&B team or user that owns the project (null: the logged-in user's default entity)."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""
    mode: Literal["online", "offline"] | None = None
    """`offline` writes the run under RUN_DIR/wandb only (upload it later with `wandb sync`); null leaves it to W&B
    (`WANDB_MODE`, else online)."""


class MlflowConfig(Section):
    tracking_uri: str | None = None
    """MLflow tracking server (`http://host:5000`) or store; null leaves it to MLflow (`MLFLOW_TRACKING_URI`, else
    its local default)."""
    experiment: str = "distrl"
    """MLflow experiment the run is logged to (created on first use)."""
    tags: dict[str, str] = Field(default_factory=dict)
    """Tags of the MLflow run."""
