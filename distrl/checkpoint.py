"""Checkpoint layout: RUN_DIR/checkpoints/step_NNNNNN/ holds the policy (HF format, loadable by transformers and
vLLM), the optimizer and scheduler state, and the driver's state (step, data iterator position).

Learner 0 writes a checkpoint on its own node (`Learner.save_checkpoint`, atomically), and on resume every learner
reads it on its own: with learners on several nodes, `run.output_dir` must be storage they all see.
"""

from __future__ import annotations

import json
from pathlib import Path

PREFIX = "step_"


def path_for(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{PREFIX}{step:06d}"


def latest(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (temporary directories of an interrupted save are ignored)."""
    found = sorted(p for p in (run_dir / "checkpoints").glob(f"{PREFIX}*") if not p.name.endswith(".tmp"))
    return found[-1] if found else None


def driver_state(path: Path) -> dict:
    """The driver's state saved with a checkpoint: at least `step`."""
    return json.loads((path / "driver_state.json").read_text())
