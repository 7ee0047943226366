"""From a YAML file and `--set` overrides to a validated `Config`, and back to YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from distrl.config.correction import CORRECTION
from distrl.config.learner import LR_SCHEDULE, STRATEGY
from distrl.config.loop import LOOP
from distrl.config.loss import KL, POLICY
from distrl.config.root import Config
from distrl.config.sources import (
    ConfigError,
    Origins,
    VariantsByPath,
    apply_override,
    format_validation_error,
    yaml_origins,
)

VARIANTS: VariantsByPath = {
    ("loss", "policy"): POLICY,
    ("loss", "kl"): KL,
    ("loss", "correction"): CORRECTION,
    ("learner", "lr_schedule"): LR_SCHEDULE,
    ("learner", "strategy"): STRATEGY,
    ("critic", "lr_schedule"): LR_SCHEDULE,
    ("critic", "strategy"): STRATEGY,
    ("loop",): LOOP,
}
"""Every discriminated union of the tree, by field path: for shorthand in overrides and for error messages."""


def from_dict(tree: dict[str, Any], source: str = "<config>", origins: Origins | None = None) -> Config:
    """Validate a raw mapping; raise ConfigError listing every bad field path."""
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        lines = format_validation_error(err, origins, VARIANTS)
        head = f"invalid config {source}: {len(lines)} problem{'s' if len(lines) > 1 else ''}"
        raise ConfigError("\n".join([head, *lines])) from None


def load(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a YAML config, apply `key=value` overrides in order, validate.

    Relative paths inside the file (model.path, data.path, ...) are kept as written: they resolve against the
    working directory, as a Ray job's `--working-dir` expects.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        tree = yaml.safe_load(text) or {}
        origins = yaml_origins(text, str(path))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(tree).__name__}")
    for override in overrides:
        apply_override(tree, override, origins, VARIANTS)
    return from_dict(tree, source=str(path), origins=origins)


def to_yaml(cfg: Config) -> str:
    """The resolved config, every default filled in, as YAML."""
    return yaml.safe_dump(cfg.model_dump(mode="json", by_alias=True), sort_keys=False)
