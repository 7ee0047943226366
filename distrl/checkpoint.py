"""Checkpoints: RUN_DIR/checkpoints/step_NNNNNN/ holds the policy (HF format, loadable by transformers and vLLM),
the optimizer and scheduler state, and the driver's state (step, data iterator position). A checkpoint directory is
written under a temporary name and renamed when complete, so a crash never leaves a half-written one behind."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import ray

from distrl.cluster.group import ActorGroup
from distrl.workers.learner import Learner

PREFIX = "step_"


def save(run_dir: Path, step: int, learners: ActorGroup[Learner], driver_state: dict) -> Path:
    final = run_dir / "checkpoints" / f"{PREFIX}{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # Replicas are identical; learner 0 writes.
    ray.get(learners.call(0, Learner.save_checkpoint, str(tmp)))
    (tmp / "driver_state.json").write_text(json.dumps({"step": step, **driver_state}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def latest(run_dir: Path) -> Path | None:
    found = sorted(p for p in (run_dir / "checkpoints").glob(f"{PREFIX}*") if not p.name.endswith(".tmp"))
    return found[-1] if found else None


def restore(path: Path, learners: ActorGroup[Learner]) -> dict:
    """Load the checkpoint into every learner; returns the driver state (with `step`)."""
    ray.get(learners.map(Learner.load_checkpoint, str(path)))
    return json.loads((path / "driver_state.json").read_text())
