"""Experiment trackers for real: a training run on the local backend logs every step to MLflow (a real tracking
server that this module starts on 127.0.0.1, its store in a temporary directory, read back through MLflow's client)
and to W&B (offline, read back from the run's own .wandb files); a resumed run continues both tracker runs; a tracker
whose server dies mid-run is named in one warning and dropped while training finishes. Nothing touches HOME."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import urllib.request
import warnings
from contextlib import nullcontext
from pathlib import Path

import pytest
import yaml

from distrl import config
from distrl.driver import train
from distrl.run_dir import RunDir
from distrl.stop import Stopped
from distrl.trackers import IDS, Trackers
from distrl.trackers.base import Tracker
from distrl.trackers.mlflow import flatten, metric_name
from tests.hf_rollout import HFRolloutWorker
from tests.test_driver_local import local_config, rows
from tests.test_run_dir import row

MLFLOW_START_S = 180  # mlflow-skinny's server (Flask, SQLAlchemy): about 20 s to answer on a busy 2-core machine


@pytest.fixture(autouse=True)
def no_home(tmp_path_factory, monkeypatch) -> Path:
    """HOME and every W&B and MLflow directory in a temporary directory; W&B offline and silent about errors."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    for name in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(name, str(home / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on 127.0.0.1 with its runs in a SQLite file and its artifacts in `root`; `stop()` kills its
    process group (the server and its uvicorn worker)."""

    def __init__(self, root: Path):
        root.mkdir(parents=True, exist_ok=True)
        self.uri = f"http://127.0.0.1:{free_port()}"
        port = self.uri.rsplit(":", 1)[1]
        self.log = (root / "server.log").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", port, "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
             str(root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
            env={**os.environ, "HOME": str(root)})
        deadline = time.monotonic() + MLFLOW_START_S
        while not self._healthy():
            assert self.process.poll() is None, (root / "server.log").read_text()
            assert time.monotonic() < deadline, f"mlflow server not up in {MLFLOW_START_S} s"
            time.sleep(0.5)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        self.log.close()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield server
    server.stop()


def wandb_records(path: Path):
    """The records of one W&B .wandb file: a 7-byte header (`:W&B`, magic, version), then LevelDB's log format
    (32 KiB blocks of chunks: CRC32, length, type; FULL = 1, FIRST = 2, MIDDLE = 3, LAST = 4; a block's last
    < 7 bytes are padding), each record a `wandb_internal_pb2.Record`."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", path
    pos, parts = 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def wandb_runs(run_dir: Path) -> list[dict]:
    """Each offline W&B run under RUN_DIR/wandb, oldest first: its id, config, history rows (key -> value, W&B's
    own `_` keys left out), summary and exit code."""
    found = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        run: dict = {"history": [], "summary": {}, "config": {}, "exit_code": None}
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["tags"] = record.run.run_id, list(record.run.tags)
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                run["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                       for i in record.history.item if not (i.key or i.nested_key[0]).startswith("_")})
            elif kind == "summary":
                run["summary"].update({u.key or "/".join(u.nested_key): json.loads(u.value_json)
                                       for u in record.summary.update})
            elif kind == "exit":
                run["exit_code"] = record.exit.exit_code
        found.append(run)
    return found


def mlflow_history(uri: str, run_id: str, keys) -> dict[str, dict[int, list[float]]]:
    """key -> step -> the values MLflow holds for it, in the order logged."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    history: dict[str, dict[int, list[float]]] = {}
    for key in keys:
        for metric in sorted(client.get_metric_history(run_id, metric_name(key)), key=lambda m: m.timestamp):
            history.setdefault(key, {}).setdefault(metric.step, []).append(metric.value)
    return history


def same(a: float, b: float) -> bool:
    """Equal as logged: NaN is NaN, and MLflow stores an infinity as the largest float."""
    if a != a:  # noqa: PLR0124 - NaN
        return b != b  # noqa: PLR0124 - NaN
    return a == b or (abs(a) == float("inf") and abs(b) == sys.float_info.max and (a > 0) == (b > 0))


def tracked_config(tmp_path: Path, model_dir: Path, uri: str, *overrides: str) -> config.Config:
    return local_config(tmp_path, model_dir, "run.trackers=[jsonl, wandb, mlflow]", f"run.mlflow.tracking_uri={uri}",
                        "run.mlflow.experiment=tracked", "run.mlflow.tags={team: rl}", "run.wandb.project=tracked",
                        "run.wandb.tags=[smoke]", "run.wandb.mode=offline", "run.checkpoint_every=1", *overrides)


def test_mlflow_and_wandb_hold_every_step_and_a_resumed_run_continues_both(tmp_path, tiny_model_dir, mlflow_server):
    from mlflow.tracking import MlflowClient

    train(tracked_config(tmp_path, tiny_model_dir, mlflow_server.uri, "run.steps=2"), rollout_worker=HFRolloutWorker)
    run_dir = tmp_path / "quickstart"
    ids = json.loads((run_dir / IDS).read_text())
    assert set(ids) == {"wandb", "mlflow"}
    resumed = tracked_config(tmp_path, tiny_model_dir, mlflow_server.uri, "run.steps=3", "run.resume=true")
    train(resumed, rollout_worker=HFRolloutWorker)
    assert json.loads((run_dir / IDS).read_text()) == ids  # the same tracker runs, continued
    logged = rows(resumed)
    assert [r["step"] for r in logged] == [1, 2, 3]

    # MLflow: every key of every row at its step, exactly once (step 3 was the only one trained after the resume).
    client = MlflowClient(mlflow_server.uri)
    run = client.get_run(ids["mlflow"])
    assert run.info.status == "FINISHED" and run.info.run_name == "quickstart"
    assert run.data.tags["team"] == "rl"
    assert client.get_experiment(run.info.experiment_id).name == "tracked"
    keys = {k for r in logged for k in r if k != "step"}
    history = mlflow_history(mlflow_server.uri, ids["mlflow"], keys)
    for r in logged:
        for key, value in r.items():
            if key != "step" and value is not None:
                assert len(history[key][r["step"]]) == 1 and same(value, history[key][r["step"]][0]), (key, r["step"])
    assert run.data.params["run.mlflow.experiment"] == "tracked"
    assert run.data.params["run.steps"] == "2"  # MLflow keeps a param's first value; config.yaml has the latest
    artifact = client.download_artifacts(ids["mlflow"], "config.yaml", str(tmp_path))
    assert config.from_dict(yaml.safe_load(Path(artifact).read_text())) == resumed

    # W&B: two offline runs (the first, then its continuation) under one id; together they hold every row.
    first, second = wandb_runs(run_dir)
    assert first["id"] == second["id"] == ids["wandb"] and first["tags"] == ["smoke"]
    assert (first["config"]["run"]["steps"], second["config"]["run"]["steps"]) == (2, 3)
    assert first["summary"]["end_state"] == second["summary"]["end_state"] == "finished"
    assert first["exit_code"] == second["exit_code"] == 0
    tracked = {h["step"]: h for h in first["history"] + second["history"]}
    assert sorted(tracked) == [1, 2, 3]
    for r in logged:
        shown = {k: v for k, v in r.items() if v is not None}
        assert tracked[r["step"]].keys() == shown.keys(), r["step"]
        assert all(same(v, tracked[r["step"]][k]) for k, v in shown.items()), r["step"]


def test_a_tracker_whose_server_dies_mid_run_is_named_once_and_dropped(tmp_path, tiny_model_dir, monkeypatch):
    server = MlflowServer(tmp_path / "server")
    try:
        # One try per request: MLflow's default (7 retries with back-off, about 4 minutes) would only be slower.
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        log = RunDir.log

        def log_then_kill(run, step, row):
            log(run, step, row)
            if step == 1:  # once MLflow holds step 1 (a thread sends it), the server dies
                run_id = json.loads((run.path / IDS).read_text())["mlflow"]
                deadline = time.monotonic() + 60
                while not mlflow_history(server.uri, run_id, ["reward/mean"]).get("reward/mean"):
                    assert time.monotonic() < deadline, "step 1 never reached the MLflow server"
                    time.sleep(0.1)
                server.stop()

        monkeypatch.setattr(RunDir, "log", log_then_kill)
        cfg = local_config(tmp_path / "runs", tiny_model_dir, "run.steps=3", "run.trackers=[jsonl, mlflow]",
                           f"run.mlflow.tracking_uri={server.uri}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            history = train(cfg, rollout_worker=HFRolloutWorker)
    finally:
        server.stop()
    assert [h["step"] for h in rows(cfg)] == [1, 2, 3] and len(history) == 3  # training finished
    named = [str(w.message) for w in caught if "run.trackers" in str(w.message)]
    assert len(named) == 1, named
    assert named[0].startswith("run.trackers: mlflow failed to log step 2 and is disabled for the rest of this run")
    assert "127.0.0.1" in named[0]  # the error itself: the server it could not reach


class Fake(Tracker):
    """A tracker that keeps what it is given; `fail_at`: the step whose `log` raises."""

    name = "fake"

    def __init__(self, fail_at: int | None = None):
        self.fail_at, self.steps, self.states, self.started = fail_at, [], [], []

    def start(self, config, run_id):
        self.started.append((config["run"]["name"], run_id))
        return run_id or "run-1"

    def log(self, step, row):
        if step == self.fail_at:
            raise ConnectionError("server gone")
        self.steps.append(step)

    def finish(self, state):
        self.states.append(state)


def run_dir_cfg(tmp_path, *overrides):
    return config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "run": {
        "output_dir": str(tmp_path), "trackers": ["jsonl"], "ray_metrics": False, "progress": False, "steps": 3,
        **dict(overrides)}})


def test_a_failing_tracker_warns_once_and_the_others_get_every_step(tmp_path):
    steady, failing = Fake(), Fake(fail_at=2)
    warned = pytest.warns(RuntimeWarning, match=r"run\.trackers: fake failed to log step 2 and is disabled .*"
                                                r"ConnectionError: server gone")
    with warned as caught, RunDir(run_dir_cfg(tmp_path)) as run:  # the warning comes at step 3 or at the end
        run.trackers = Trackers([steady, failing])
        for step in (1, 2, 3):
            run.log(step, row(0.5))
    assert len(caught) == 1
    assert (steady.steps, steady.states) == ([1, 2, 3], ["finished"])
    assert (failing.steps, failing.states) == ([1], [])  # dropped: never called again, not even to finish
    assert [json.loads(line)["step"] for line in (run.path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def test_rows_are_sent_by_a_thread_so_a_slow_tracker_never_holds_the_step(tmp_path, monkeypatch):
    import threading

    import distrl.trackers

    release = threading.Event()

    class Stuck(Fake):
        def log(self, step, row):
            release.wait()  # a server that does not answer
            super().log(step, row)

    stuck = Stuck()
    with RunDir(run_dir_cfg(tmp_path)) as run:
        run.trackers = Trackers([stuck])
        for step in (1, 2, 3):
            run.log(step, row(0.5))  # returns although the tracker has not sent step 1
        assert stuck.steps == []
        release.set()
    assert (stuck.steps, stuck.states) == ([1, 2, 3], ["finished"])  # the end waits for the queued rows

    release.clear()
    monkeypatch.setattr(distrl.trackers, "FINISH_S", 0.2)
    never = Stuck()
    warned = pytest.warns(RuntimeWarning, match=r"fake was still sending rows 0 s after the run ended; its run is "
                                                r"left unmarked")
    with warned, RunDir(run_dir_cfg(tmp_path, ("overwrite", True))) as run:
        run.trackers = Trackers([never])
        run.log(1, row(0.5))
    assert never.states == []
    release.set()


@pytest.mark.parametrize(("steps", "raised", "state"), [
    (3, None, "finished"), (2, None, "stopped"), (1, RuntimeError("boom"), "failed"),
    (1, Stopped("SIGTERM", 143, "stopped"), "stopped"), (1, KeyboardInterrupt(), "stopped")])
def test_the_run_directory_closes_its_trackers_with_the_runs_end_state(tmp_path, steps, raised, state):
    tracker = Fake()
    with pytest.raises(type(raised)) if raised else nullcontext(), RunDir(run_dir_cfg(tmp_path)) as run:
        run.trackers = Trackers([tracker])
        for step in range(1, steps + 1):
            run.log(step, row(0.5))
        if raised:
            raise raised
    assert tracker.states == [state]


def test_tracker_ids_are_kept_for_a_resume_and_a_failed_start_names_the_tracker(tmp_path, monkeypatch):
    from distrl.trackers import TRACKERS, TrackerError

    made: list[Fake] = []
    monkeypatch.setitem(TRACKERS, "wandb", lambda cfg, run_dir: made.append(Fake()) or made[-1])
    cfg = run_dir_cfg(tmp_path, ("trackers", ["jsonl", "wandb"]))
    Trackers().start(cfg, tmp_path, resumed=False)
    assert json.loads((tmp_path / IDS).read_text()) == {"wandb": "run-1"}
    (tmp_path / IDS).write_text(json.dumps({"wandb": "kept"}))
    Trackers().start(cfg, tmp_path, resumed=True)
    Trackers().start(cfg, tmp_path, resumed=False)  # a fresh run (run.overwrite) opens a new tracker run
    assert [f.started for f in made] == [[("run", None)], [("run", "kept")], [("run", None)]]

    def unreachable(self, config, run_id):
        raise ConnectionError("no route to the server")

    monkeypatch.setattr(Fake, "start", unreachable)
    with pytest.raises(TrackerError, match=r"run\.trackers: wandb could not start its run: ConnectionError: no route"):
        Trackers().start(cfg, tmp_path, resumed=False)

    def not_installed(self, config, run_id):
        raise ModuleNotFoundError("No module named 'wandb'")

    monkeypatch.setattr(Fake, "start", not_installed)
    with pytest.raises(TrackerError, match=r"lists wandb, but wandb cannot be imported .* 'distrl\[trackers\]'"):
        Trackers().start(cfg, tmp_path, resumed=False)


def test_mlflow_names_and_params():
    assert metric_name("correction/mismatch_kl/staleness_4+") == "correction/mismatch_kl/staleness_4plus"
    assert metric_name("eval/gsm8k/pass@4") == "eval/gsm8k/pass_at_4"
    assert metric_name("agent/tool:python (calls)") == "agent/tool:python _calls_"
    assert flatten({"a": {"b": 1, "c": None}, "d": [1, 2], "e": "x", "f": {}}) == {
        "a.b": "1", "a.c": "null", "d": "[1, 2]", "e": "x", "f": "{}"}
