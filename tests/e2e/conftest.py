"""Shared pieces of the end-to-end tests: real Ray (127.0.0.1 only), real vLLM CPU, the tiny model."""

import os
import sys
from pathlib import Path

import pytest

from distrl import config

ROOT = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)


def quickstart(tmp_path: Path, *overrides: str) -> config.Config:
    """The quickstart config, writing into tmp_path, without progress bar or Ray gauges, plus `overrides`."""
    return config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={tmp_path.parent / 'tiny-model'}", f"run.output_dir={tmp_path}", "run.progress=false",
        *overrides])


@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster for a test module; `tests` importable by reward tasks (faulty_rewards)."""
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    yield
    ray.shutdown()


def cli_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's bin first on PATH (distrl, ray), repo importable."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env
