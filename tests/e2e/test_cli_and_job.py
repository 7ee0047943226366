"""The command line and Ray job paths: a bad config fails before any actor starts; SIGTERM finishes the step,
checkpoints it and leaves no Ray process behind, nor does SIGKILL, after which a resume gives exactly the rows of
a run that was never interrupted; `ray start --head` as the docs say turns token auth on (a head the test starts on
127.0.0.1, with its own HOME and temp dir, and stops, leaving any other cluster on the machine alone); `ray job
submit` to the session's cluster of three nodes runs the quickstart with its roles on the nodes the config names,
and the dashboard lists each node's actors."""

import json
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from .conftest import ROOT, all_ended, cli_env, free_port, outcome, start_quickstart


def test_bad_config_fails_before_any_actor_starts(tmp_path):
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           "--set", "loss.correction.low=5", "--set", f"run.output_dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2
    assert "loss.correction.low (5.0) must be < loss.correction.high" in result.stderr
    assert "--set loss.correction.low=5" in result.stderr
    assert not (tmp_path / "quickstart").exists(), "a run directory was created for an invalid config"
    assert "ray: " not in result.stdout  # no cluster was started (the driver prints one line when it connects)


def test_unknown_reward_function_fails_before_any_actor_starts(tmp_path):
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           "--set", "reward.function=distrl.nowhere:nothing", "--set", f"run.output_dir={tmp_path}"]
    result = subprocess.run(cmd, cwd=ROOT, env=cli_env(), capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "reward.function: reward function 'distrl.nowhere:nothing'" in result.stderr
    assert "Traceback" not in result.stderr
    assert "ray: " not in result.stdout


def test_sigterm_finishes_the_step_and_leaves_no_ray_process_behind(tmp_path):
    psutil = pytest.importorskip("psutil")
    proc, metrics = start_quickstart(tmp_path)
    cluster = psutil.Process(proc.pid).children(recursive=True)  # GCS, raylet, dashboard, agents, actors
    assert cluster, "the embedded cluster's processes should be the driver's descendants"
    proc.terminate()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "stopped by SIGTERM after step" in err and "continue with --set run.resume=true" in err
    assert "SIGABRT" not in err and "Aborted" not in err and "*** SIG" not in err, err[-3000:]
    assert not all_ended(cluster, timeout=15), "outlived the driver"
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert (tmp_path / "quickstart" / "checkpoints" / f"step_{steps[-1]:06d}" / "manifest.json").is_file()


def test_sigkill_of_the_driver_leaves_no_ray_process_behind_and_resume_gives_the_uninterrupted_rows(tmp_path):
    # Without distrl's reaper, Ray's dashboard and runtime-env agents outlive a SIGKILLed driver for minutes.
    psutil = pytest.importorskip("psutil")
    run = ("run.steps=6", "run.checkpoint_every=1")
    proc, metrics = start_quickstart(tmp_path, *run)
    cluster = psutil.Process(proc.pid).children(recursive=True)
    proc.kill()
    out, _ = proc.communicate(timeout=30)
    running = all_ended(cluster, timeout=20)
    assert not running, [(p.pid, p.name()) for p in cluster if p.pid in running]
    token = re.search(r"its token is in (\S+) while the run lasts", out)  # absent when the user has a token
    assert token is None or not Path(token[1]).exists(), "the run's Ray token outlived it"
    killed_at = len(metrics.read_text().splitlines())
    assert 2 <= killed_at < 6

    # Resumed from the newest complete checkpoint, the run gives the rows of one never interrupted, each step once.
    train = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml"]
    for out, extra in ((tmp_path, ("run.resume=true",)), (tmp_path / "whole", ())):
        settings = (f"run.output_dir={out}", f"model.path={tmp_path / 'model'}", "run.progress=false", *run, *extra)
        result = subprocess.run([*train, *(a for s in settings for a in ("--set", s))], cwd=ROOT, env=cli_env(),
                                capture_output=True, text=True, timeout=400, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
    rows = outcome(metrics)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows == outcome(tmp_path / "whole" / "quickstart" / "metrics.jsonl")


def http_status(url: str, token: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.fixture
def local_cluster(tmp_path):
    """A head node of the test's own on 127.0.0.1 with token authentication on, started as the docs say; yields
    (dashboard address, the token), then stops exactly that head's processes.

    Nothing touches the real home directory: the subprocesses' HOME is tmp_path/home, where
    `ray get-auth-token --generate` writes the token. `ray start --head` turns token auth on only with
    RAY_AUTH_MODE=token (with no token it would start with auth off), and clients need both the token and
    RAY_AUTH_MODE=token. `ray stop` would stop every Ray cluster on this machine, so the head runs with --block
    and is stopped by signalling that one process, which shuts down what it started; its session lives in a
    --temp-dir of its own (under /tmp: Ray's socket paths must fit in 107 bytes, tmp_path is too deep).
    """
    env = cli_env()
    for key in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    env["HOME"] = str(tmp_path / "home")
    (tmp_path / "home").mkdir()
    token = subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True,
                           text=True, timeout=120).stdout.strip()
    env["RAY_AUTH_MODE"] = "token"
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    # Ports Ray would otherwise take at fixed defaults (6379, 8265, 10001, 52365), where another cluster may be.
    gcs, dash, client, agent = free_port(), free_port(), free_port(), free_port()
    log = tmp_path / "head.log"
    with log.open("w") as out:
        head = subprocess.Popen(
            ["ray", "start", "--head", "--block", f"--port={gcs}", "--node-ip-address=127.0.0.1",
             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", f"--ray-client-server-port={client}",
             f"--dashboard-agent-listen-port={agent}", f"--temp-dir={temp_dir}", "--num-cpus=2",
             "--disable-usage-stats"],
            env=env, stdout=out, stderr=subprocess.STDOUT)
    address = f"http://127.0.0.1:{dash}"
    try:
        wait_for_jobs_api(head, address, token, agent, log)
        yield address, token
    finally:
        stop_head(head, temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def wait_for_jobs_api(head: subprocess.Popen, address: str, token: str, agent_port: int, log: Path) -> None:
    """Until the dashboard answers the jobs API and the head's dashboard agent, which runs submitted jobs, listens."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert head.poll() is None, f"ray start --head exited ({head.returncode}):\n{log.read_text()[-3000:]}"
        try:
            with socket.create_connection(("127.0.0.1", agent_port), timeout=5):
                pass
            if http_status(f"{address}/api/jobs/", token) == 200:
                return
        except OSError:  # not listening yet
            pass
        time.sleep(1)
    raise TimeoutError(f"the head's jobs API did not come up in 180 s:\n{log.read_text()[-3000:]}")


def stop_head(head: subprocess.Popen, temp_dir: str) -> None:
    """SIGTERM to `ray start --block`, which stops the processes it started; any straggler of this cluster (a child
    of the head, or a process named after its temp dir) is then killed by its id, never by a name shared with other
    clusters."""
    import psutil  # vLLM's dependency, so always there where these tests run

    ours = set(psutil.Process(head.pid).children(recursive=True)) if head.poll() is None else set()
    head.terminate()
    try:
        head.wait(timeout=90)
    except subprocess.TimeoutExpired:
        head.kill()
        head.wait()
    for process in psutil.process_iter(["cmdline"]):
        if temp_dir in " ".join(process.info["cmdline"] or []):
            ours.add(process)
    _, alive = psutil.wait_procs(ours, timeout=15)
    for process in alive:
        process.kill()


def test_ray_start_head_turns_token_auth_on(local_cluster, tmp_path):
    address, token = local_cluster
    # Token authentication is really on: the jobs API refuses a request without the token.
    assert http_status(f"{address}/api/jobs/") == 401 and http_status(f"{address}/api/jobs/", token) == 200
    assert (tmp_path / "home" / ".ray" / "auth_token").read_text().strip() == token


def test_ray_job_submit_runs_quickstart_on_the_nodes_the_config_names(ray_session, tmp_path):
    """The job's driver joins the cluster it was submitted to; its roles go where their labels say; the run
    directory is an absolute path, which every node of this host sees (on several machines: storage every node
    mounts)."""
    nodes = ray_session
    env = {**cli_env(), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": nodes.token}
    assert http_status(f"{nodes.dashboard}/api/jobs/") == 401
    cmd = ["ray", "job", "submit", "--address", nodes.dashboard, "--working-dir", ".", "--",
           sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           "--set", "run.steps=2", "--set", "run.name=job", "--set", f"run.output_dir={tmp_path}",
           "--set", "run.progress=false", "--set", "eval=null",
           "--set", "cluster.rollout.labels={pool: inference}", "--set", "cluster.learner.labels={pool: train}",
           "--set", "cluster.reference.labels={pool: head}"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    assert "succeeded" in result.stdout
    rows = [json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # The dashboard (its state API, with the token) lists the job's actors, each on the node its role names.
    request = urllib.request.Request(f"{nodes.dashboard}/api/v0/actors?limit=10000&detail=1",
                                     headers={"Authorization": f"Bearer {nodes.token}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        listed = json.load(response)["data"]["result"]["result"]
    where = {a["name"].rsplit("/", 1)[1]: a["node_id"] for a in listed if a.get("name", "").startswith("distrl/job/")}
    assert where == {"rollout-0": nodes.named["inference"].node_id, "learner-0": nodes.named["train"].node_id,
                     "reference-0": nodes.named["head"].node_id}
