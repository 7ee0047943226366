"""The command line and Ray job paths: a bad config fails before any actor starts; `ray job submit` runs the
quickstart against a local cluster started (with token auth, on 127.0.0.1) and stopped by the test."""

import json
import socket
import subprocess
import sys
import time

import pytest

from .conftest import ROOT, cli_env


def test_bad_config_fails_before_any_actor_starts(tmp_path):
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           "--set", "loss.correction.low=5", "--set", f"run.output_dir={tmp_path}"]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "loss.correction.low (5.0) must be < loss.correction.high" in result.stderr
    assert "--set loss.correction.low=5" in result.stderr
    assert not (tmp_path / "quickstart").exists(), "a run directory was created for an invalid config"
    assert time.monotonic() - start < 60


def test_unknown_reward_function_fails_before_any_actor_starts(tmp_path):
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           "--set", "reward.function=distrl.nowhere:nothing", "--set", f"run.output_dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode != 0 and "distrl.nowhere:nothing" in result.stderr
    assert "ray: " not in result.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def local_cluster(tmp_path):
    """`ray start --head` on 127.0.0.1 (token auth on by default), stopped afterwards."""
    env = cli_env()
    env.pop("RAY_AUTH_MODE", None)
    env.pop("RAY_ADDRESS", None)
    gcs, dash = free_port(), free_port()
    subprocess.run(["ray", "start", "--head", f"--port={gcs}", "--node-ip-address=127.0.0.1",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--num-cpus=2",
                    "--disable-usage-stats"], env=env, check=True, capture_output=True, timeout=120)
    try:
        yield f"http://127.0.0.1:{dash}", env
    finally:
        subprocess.run(["ray", "stop", "--force"], env=env, capture_output=True, timeout=120, check=False)


def test_ray_job_submit_runs_quickstart(local_cluster, tmp_path):
    address, env = local_cluster
    env = {**env, "RAY_AUTH_MODE": "token"}  # the client side of token auth (README's auth step)
    cmd = ["ray", "job", "submit", "--address", address, "--working-dir", ".", "--",
           "distrl", "train", "--config", "configs/quickstart.yaml", "--set", "run.steps=2",
           "--set", f"run.output_dir={tmp_path}", "--set", "run.progress=false"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
