"""The shipped monitoring set-up (deploy/monitoring), checked as files: every query of the Grafana dashboard names a
metric that distrl's loop really writes (found by running it) or that Ray exports, the dashboard shows the figures
users watch, and Prometheus and Grafana are pointed where Ray writes. Grafana cannot run here (Debian has no
package); Prometheus against a real run is tests/e2e/test_monitoring.py."""

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from distrl import config
from distrl.driver import train
from distrl.metrics import gauge_name
from tests.hf_rollout import HFRolloutWorker

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "deploy" / "monitoring"
GRAFANA = MONITORING / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "distrl.json"
# Words of PromQL that are not metric names where they stand alone (aggregation functions are followed by `(`).
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny_model_dir) -> set[str]:
    """The Prometheus name of every figure distrl's loop writes to Ray (RayMetricsSink: `step` and each row's
    measured keys), from a run on the local backend: the asynchronous loop with staleness up to 2 (the staleness
    buckets 0 to 2, those the dashboard shows) and a checkpoint. It writes every key the synchronous loop does (a key
    only that loop wrote would make the test below fail, not pass). Then a short multi-turn job (an `env` section) for
    the `agent/*` figures."""
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path_factory.mktemp('run')}", "run.progress=false",
        "run.ray_metrics=false", "run.tensorboard=false", "cluster.backend=local", "rollout.prompts_per_step=4",
        "rollout.n_samples_per_prompt=4", "rollout.sampling.max_new_tokens=6", "learner.micro_batch_size=16",
        "loop.mode=async", "loop.max_staleness=2", "run.steps=5", "run.checkpoint_every=2"])
    rows = train(cfg, rollout_worker=HFRolloutWorker)
    # And a multi-turn job, for the agent/* figures.
    agent = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path_factory.mktemp('agent')}", "run.progress=false",
        "run.ray_metrics=false", "run.tensorboard=false", "cluster.backend=local", "rollout.prompts_per_step=2",
        "rollout.n_samples_per_prompt=2", "rollout.sampling.max_new_tokens=4", "learner.micro_batch_size=4",
        "run.steps=2", "env.class=tests.agent_envs:Chatter", "env.kwargs.turns=2", "eval=null"])
    rows += train(agent, rollout_worker=HFRolloutWorker)
    keys = {"step"} | {k for row in rows for k, v in row.items() if v is not None and math.isfinite(v)}
    return {"ray_" + gauge_name(key) for key in keys}  # RayMetricsSink skips null and non-finite values


@pytest.fixture(scope="module")
def ray_metrics() -> set[str]:
    """The metrics that the installed Ray's own default Grafana dashboard queries."""
    from ray.dashboard.modules.metrics.grafana_dashboard_factory import generate_default_grafana_dashboard

    content, _ = generate_default_grafana_dashboard()
    return set(re.findall(r"\bray_[A-Za-z0-9_]+", content))


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels() -> list[dict]:
    """Every panel but the rows, also those inside collapsed rows."""
    top = dashboard()["panels"]
    return [p for panel in top for p in [panel, *panel.get("panels", [])] if p["type"] != "row"]


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable (`label_values(SERIES, LABEL)`: its SERIES)."""
    found = [(p["title"], t["expr"]) for p in panels() for t in p["targets"]]
    found += [(f"variable {v['name']}", re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", v["query"]["query"]))
              for v in dashboard()["templating"]["list"] if v["type"] == "query"]
    return found


def metric_names(expr: str) -> list[str]:
    """The metric names in PromQL `expr`: the identifiers left once label matchers, ranges, `by (...)` clauses,
    strings and function calls are taken out."""
    bare = re.sub(r'\{[^}]*\}|\[[^\]]*\]|"[^"]*"|\b(?:by|without)\s*\([^)]*\)', " ", expr)
    return [name for name in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*(?![A-Za-z0-9_:]*\s*\()", bare)
            if name not in KEYWORDS]


def test_metric_names_are_read_from_promql():
    assert metric_names('sum(ray_actors{Source="gcs"}) by (State)') == ["ray_actors"]
    assert metric_names('ray_distrl_reward_mean{run=~"$run"} / on() sum(ray_x[5m])') == [
        "ray_distrl_reward_mean", "ray_x"]


def test_every_query_names_a_metric_that_is_exported(exported, ray_metrics):
    """A renamed metric (in distrl's code or in Ray) leaves a panel that would show nothing: this fails instead."""
    unknown = []
    for where, expr in queries():
        names = metric_names(expr)
        assert names, f"{where}: {expr} names no metric"
        known = exported if any(n.startswith("ray_distrl_") for n in names) else ray_metrics
        unknown += [f"{where}: {name}" for name in names if name not in known]
    assert not unknown, f"not exported: {unknown}; distrl writes {sorted(exported)}"


def test_distrl_series_are_filtered_by_the_run_variable():
    for where, expr in queries():
        for selector in re.findall(r"ray_distrl_[A-Za-z0-9_]+(?:\{[^}]*\})?", expr):
            assert where == "variable run" or selector.endswith('{run=~"$run"}'), (where, selector)


def test_the_dashboard_shows_the_figures_users_watch():
    shown = {name for _, expr in queries() for name in metric_names(expr)}
    watched = ["reward/mean", "response_length/mean", "loss/policy", "kl/ref", "correction/mismatch_kl",
               "correction/weight_mean", "correction/mismatch_kl/staleness_1", "staleness/mean", "time/generate",
               "time/update", "throughput/tokens_per_s", "faults/recoveries", "faults/rollout_restarts"]
    assert [k for k in watched if "ray_" + gauge_name(k) not in shown] == []
    assert {"ray_node_cpu_utilization", "ray_node_gpus_utilization", "ray_actors"} <= shown


def test_the_dashboard_is_well_formed_grafana_json():
    board = dashboard()
    assert board["uid"] == "distrl"  # start.sh prints /d/distrl
    ids = [p["id"] for panel in board["panels"] for p in [panel, *panel.get("panels", [])]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels():
        assert panel["title"] and panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        pos = panel["gridPos"]
        assert pos["x"] >= 0 and pos["x"] + pos["w"] <= 24 and pos["h"] > 0, panel["title"]
    # No two panels overlap.
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in panels()
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells))


def test_prometheus_reads_rays_service_discovery_file():
    from ray._private.ray_constants import PROMETHEUS_SERVICE_DISCOVERY_FILE

    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]
    files = [f for job in scrape for sd in job["file_sd_configs"] for f in sd["files"]]
    # Ray's default temporary directory, where it links the newest session's file (start.sh rewrites it for another)
    assert files == [f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}"]
    assert f"/tmp/ray/{PROMETHEUS_SERVICE_DISCOVERY_FILE}" in (MONITORING / "start.sh").read_text()


def test_grafana_provisions_the_data_source_and_dashboards_ray_expects():
    from ray.dashboard.modules.metrics.metrics_head import DEFAULT_PROMETHEUS_NAME

    sources = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert [s["name"] for s in sources["datasources"]] == [DEFAULT_PROMETHEUS_NAME]  # Ray's dashboards use it
    providers = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dashboards.yml").read_text())["providers"]
    paths = {p["name"]: p["options"]["path"] for p in providers}
    assert Path(paths["distrl"].replace("${DISTRL_GRAFANA}", str(GRAFANA))) == DASHBOARD.parent
    assert paths["Ray"] == "${RAY_TEMP_DIR}/session_latest/metrics/grafana/dashboards"
