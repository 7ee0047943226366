"""`make monitor` against a real run on the session's cluster of three nodes: deploy/monitoring/start.sh starts
Prometheus from the shipped config, which finds every node of the Ray cluster through the service-discovery file
that Ray's dashboard writes (one target per node, each scraped); PromQL then reads distrl's figures back as
metrics.jsonl has them, every panel of the Grafana dashboard that can have data has it, and the Ray dashboard
reports that Prometheus as up.

The Prometheus server is the one `make test` provides (PROMETHEUS: Debian's package unpacked into .tools/, or one
on PATH). Without one this test fails rather than skips: it is the only check that the shipped config works."""

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from distrl.driver import train
from distrl.metrics import gauge_name

from .conftest import ROOT, cli_env, quickstart

DASHBOARD = ROOT / "deploy" / "monitoring" / "grafana" / "dashboards" / "distrl.json"


def prometheus_server() -> str:
    local = ROOT / ".tools" / "prometheus" / "usr" / "bin" / "prometheus"
    found = os.environ.get("PROMETHEUS") or shutil.which("prometheus") or (str(local) if local.exists() else None)
    if found is None:
        pytest.fail("no Prometheus server: `make test` unpacks Debian's package into .tools/ (make prometheus); or "
                    "apt-get install prometheus, or set PROMETHEUS")
    return found


def query(port: int, promql: str) -> list[dict]:
    """The instant vector of `promql` (each element's `metric` labels and `value` [time, "number"])."""
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


def scraped(port: int) -> set[str]:
    """The targets Prometheus scraped at its last try ("host:port")."""
    return {r["metric"]["instance"] for r in query(port, 'up{job="ray"}') if r["value"][1] == "1"}


def ray_token() -> dict[str, str]:
    """The header that the dashboard of a cluster started by `ray.init` wants (it turns token auth on): the token of
    `loopback_cluster`, or the user's."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    token = os.environ.get("RAY_AUTH_TOKEN") or (path.read_text().strip() if path.exists() else "")
    return {"Authorization": f"Bearer {token}"} if token else {}


@pytest.fixture
def monitored_cluster(ray_session, tmp_path):
    """start.sh's Prometheus for the session's cluster, on the port its head's dashboard was told about
    (RAY_PROMETHEUS_HOST) and reading the service-discovery file in its temporary directory; yields (Prometheus
    port, dashboard address, start.sh's log), then stops Prometheus."""
    nodes = ray_session
    binary, port, log = prometheus_server(), nodes.prometheus_port, tmp_path / "monitor.log"
    env = {**cli_env(), "PROMETHEUS": binary, "PROMETHEUS_PORT": str(port), "GRAFANA": "off",
           "MONITOR_DIR": str(tmp_path / "monitor")}
    with log.open("w") as out:  # its own process group: the servers it starts are stopped with it
        monitor = subprocess.Popen([ROOT / "deploy" / "monitoring" / "start.sh", nodes.temp_dir], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while f"prometheus: http://127.0.0.1:{port}" not in log.read_text():
            assert monitor.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        yield port, nodes.dashboard, log
    finally:
        os.killpg(monitor.pid, signal.SIGTERM)
        try:
            monitor.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(monitor.pid, signal.SIGKILL)
            monitor.wait()


def test_prometheus_from_the_shipped_config_reads_a_runs_figures(monitored_cluster, tmp_path):
    import ray

    port, dashboard, log = monitored_cluster
    # The service-discovery file names every alive node's metrics export (and the head's dashboard's and
    # autoscaler's own), and Prometheus scrapes each of them.
    exports = {f"127.0.0.1:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"]}
    deadline = time.monotonic() + 60
    while not exports <= (up := scraped(port)):
        assert time.monotonic() < deadline, f"scraped {up}, not {exports}; start.sh said:\n{log.read_text()}"
        time.sleep(1)
    cfg = quickstart(tmp_path, "run.name=monitored", "run.steps=2", "rollout.prompts_per_step=4")
    train(cfg)
    last = json.loads((tmp_path / "monitored" / "metrics.jsonl").read_text().splitlines()[-1])

    # Ray exports a gauge some seconds after it is set, and Prometheus scrapes every 5 s: wait for the last step.
    deadline = time.monotonic() + 60
    while [float(r["value"][1]) for r in query(port, 'ray_distrl_step{run="monitored"}')] != [2.0]:
        assert time.monotonic() < deadline, f"step 2 never reached Prometheus; start.sh said:\n{log.read_text()}"
        time.sleep(1)
    for key in ("reward/mean", "response_length/mean", "loss/policy", "kl/ref", "correction/mismatch_kl",
                "time/generate", "throughput/tokens_per_s"):
        (series,) = query(port, f'ray_{gauge_name(key)}{{run="monitored"}}')
        assert float(series["value"][1]) == pytest.approx(last[key], rel=1e-9, abs=1e-12), key
    (mean_reward,) = query(port, 'avg_over_time(ray_distrl_reward_mean{run="monitored"}[10m])')
    assert 0 <= float(mean_reward["value"][1]) <= 1  # the toy task's rewards

    # Each panel of the Grafana dashboard has data, but those about GPUs (none here) and those only multi-turn jobs
    # (an env section) fill: every query an agent/* figure (tests/test_monitoring.py finds those in such a run).
    board = json.loads(DASHBOARD.read_text())
    empty = [p["title"] for row in board["panels"] for p in [row, *row.get("panels", [])]
             if p["type"] != "row" and "GPU" not in p["title"]
             and not all("ray_distrl_agent_" in t["expr"] for t in p["targets"])
             and not any(query(port, t["expr"].replace("$run", "monitored")) for t in p["targets"])]
    assert empty == []

    # The Ray dashboard, started with RAY_PROMETHEUS_HOST, finds this Prometheus (its metrics view asks the same).
    request = urllib.request.Request(f"{dashboard}/api/prometheus_health", headers=ray_token())
    with urllib.request.urlopen(request, timeout=10) as response:
        assert json.load(response)["result"] is True
