"""Shared pieces of the end-to-end tests: real Ray (127.0.0.1 only), real vLLM CPU, the tiny model."""

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from distrl import config

from .nodes import Nodes, driver_env, free_port  # noqa: F401 - free_port: the tests' import of it

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)


def without_eval(overrides: tuple[str, ...]) -> list[str]:
    """The quickstart's held-out evaluation is left out of tests that do not name an `eval` setting themselves
    (`tests/e2e/test_quickstart.py` and the evaluation tests check it): it would add an evaluation to the last step
    of each short run, and to the runs killed on purpose."""
    return [] if any(o.startswith("eval") for o in overrides) else ["eval=null"]


def quickstart(tmp_path: Path, *overrides: str) -> config.Config:
    """The quickstart config, writing into tmp_path, without progress bar or Ray gauges, plus `overrides`."""
    return config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={tmp_path.parent / 'tiny-model'}", f"run.output_dir={tmp_path}", "run.progress=false",
        *without_eval(overrides), *overrides])


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Nodes]:
    """The session's Ray cluster, started once by the first test that needs it and stopped after the last: three
    nodes on 127.0.0.1 (`tests/e2e/nodes.py`), token auth on, the dashboard on the head."""
    with Nodes.start() as nodes:
        yield nodes


@pytest.fixture(scope="module")
def ray_session(ray_cluster):
    """This process connected to the session's cluster for a test module; `tests` importable by reward tasks
    (faulty_rewards). Roles without labels land on whichever nodes have room, as on any cluster."""
    import ray

    ray.init(address=ray_cluster.address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield ray_cluster
    ray.shutdown()


def cli_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's bin first on PATH (distrl, ray), repo importable; without
    the session cluster's token and the switch its embedded start set (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER), as a
    user's shell would be."""
    session = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    env = {k: v for k, v in os.environ.items() if k not in session}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def start_quickstart(tmp_path: Path, *overrides: str, cluster: Nodes | None = None) -> tuple[subprocess.Popen, Path]:
    """`distrl train` on the quickstart (endless steps unless `overrides` say otherwise), once it has logged two
    steps; (process, metrics). Its stdout and stderr are pipes. On an embedded cluster of its own, or joining
    `cluster` (the session's: its actors are then this process's descendants, not the driver's)."""
    settings = [f"run.output_dir={tmp_path}", f"model.path={tmp_path / 'model'}", "run.steps=100000",
                "run.progress=false", *without_eval(overrides), *overrides]
    if cluster is not None:
        settings.append(f"cluster.address={cluster.address}")
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           *(arg for setting in settings for arg in ("--set", setting))]
    env = cli_env() if cluster is None else driver_env(cluster)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "quickstart" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no step logged; stderr:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.2)
    return proc, metrics


def outcome(metrics: Path) -> list[dict]:
    """A run's rows without the figures that measure time."""
    timing = ("time/", "throughput/", "rollout/tokens_per_s", "rollout/engine_busy_frac", "sync/bytes_per_s",
              "idle/", "agent/env_wait_s")
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(timing)}
            for line in metrics.read_text().splitlines()]


def all_ended(procs, timeout: float) -> list[int]:
    """Wait until every process in `procs` has exited (a zombie has: only its parent's wait is missing); returns
    the pids still running after `timeout` seconds."""
    from distrl.cluster.reaper import _alive

    deadline = time.monotonic() + timeout
    while (running := [p.pid for p in procs if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return running
