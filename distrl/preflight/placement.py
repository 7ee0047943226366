"""The preflight's checks of where a run goes: its run directory (made, written, reused as `run.resume` and
`run.overwrite` say; absolute in a Ray job) and, on the embedded cluster, the roles' CPUs and GPUs on this
machine; each problem one line naming its field."""

from __future__ import annotations

import math
import os
from pathlib import Path

from distrl.config import Config, RunConfig
from distrl.run_dir import reuse_problem

# Set by Ray's job supervisor in the environment of a job's entrypoint (`ray job submit -- distrl train ...`).
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def check_run_dir(run: RunConfig, problems: list[str]) -> None:
    """RUN_DIR can be made (or is a directory) and written, and holds no run that resume/overwrite do not cover;
    in a Ray job, `run.output_dir` is absolute."""
    if os.environ.get(RAY_JOB_ENV) and not Path(run.output_dir).is_absolute():
        # The job's working directory is a temporary copy per node: checkpoints written there by learner 0 are
        # invisible to the driver (a resume would find none) and are deleted with the job.
        problems.append(f"run.output_dir: '{run.output_dir}' is relative, and in a Ray job it would resolve inside "
                        f"each node's temporary copy of the working directory ({Path.cwd()} here), where the "
                        f"driver cannot see learner 0's checkpoints and the job's end deletes them. Set an absolute "
                        f"path on storage every node mounts, e.g. --set run.output_dir=/shared/runs")
        return
    path = Path(run.output_dir) / run.name
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        field = "run.name" if existing == path else "run.output_dir"
        problems.append(f"{field}: {existing} is a file, so the run directory {path} cannot be made")
        return
    if not os.access(existing, os.W_OK | os.X_OK):
        problems.append(f"run.output_dir: no permission to write in {existing}, where the run directory {path} "
                        f"would be")
        return
    problem = reuse_problem(path, run)
    if problem:
        problems.append(problem)


def check_resources(cfg: Config, problems: list[str]) -> None:
    """On the embedded cluster (this machine), the roles' CPUs and GPUs fit in what Ray will find here: otherwise
    their placement groups would wait for resources that never come. (`cluster.num_cpus`, when set, is checked
    with the config; a joined cluster's nodes are only known once connected.)"""
    c = cfg.cluster
    if c.backend != "ray" or c.address or os.environ.get("RAY_ADDRESS") or os.environ.get(RAY_JOB_ENV):
        return
    if c.num_cpus is None:
        problem = cfg.unplaceable(cpu_count(), "this machine's CPU count (cluster.num_cpus unset)", "num_cpus")
        if problem:
            problems.append(f"cluster: {problem}; lower the reservations or set cluster.num_cpus")
    import torch

    problem = cfg.unplaceable(torch.cuda.device_count(), "this machine's GPU count", "num_gpus")
    if problem:
        problems.append(f"cluster: {problem}; set the roles' num_gpus to what this machine has, or join a cluster "
                        f"with GPUs (cluster.address)")


def cpu_count() -> int:
    """CPUs this process may use, as Ray counts them for its own node: those it is allowed to run on, fewer under a
    cgroup v2 CPU quota (a container's `--cpus`), rounded up. Read here so that validation imports no Ray."""
    allowed = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return allowed
    return allowed if quota == "max" else min(allowed, math.ceil(int(quota) / int(period)))
