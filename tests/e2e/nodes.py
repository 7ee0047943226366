"""Several Ray nodes on this one host, for real: each node its own raylet and object store (objects between nodes
travel through Ray's object manager), started by Ray's own test helper (`ray.cluster_utils.Cluster`; three
`ray start` processes on one host did not come up: ../shared/probes/ray-multinode-2026-11-27.md), every listener
on 127.0.0.1 and token auth on (`distrl.cluster.backend.loopback_cluster`), each node a temporary directory of its
own, as each machine of a cluster has its own disk (Ray unpacks a job's working directory on every node when its
driver connects, replacing what is there: in one shared directory that removed the driver's own working directory
under it). A node is lost as a real one is: its raylet and every process under it killed at once, after which Ray's
GCS declares it dead when its health checks fail (about 15 s); `Cluster.remove_node` would not be the same (the node
stays listed alive, its actors answer).

The session's nodes (`LAYOUT`): the head, an inference node and a training node, each labelled `pool: <name>`;
`learner_slot` (one on the head, one on the training node) lets a test put two learners on two nodes. Tests add
nodes of their own (`add`) to lose them (`lose`) or to join a run.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

LAYOUT: dict[str, dict[str, Any]] = {
    "head": {"num_cpus": 2, "resources": {"learner_slot": 1}},
    "inference": {"num_cpus": 1},
    "train": {"num_cpus": 1, "resources": {"learner_slot": 1}},
}
"""The session's nodes: name -> Ray node arguments; each is also labelled `pool: <name>`."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Nodes:
    """A running multi-node cluster: `address` to join it, `dashboard` (http://127.0.0.1:port), `token` (the
    Authorization header value's token), `temp_dir` (where Ray keeps the session, its service-discovery file for
    Prometheus among it), `prometheus_port` (where the head's dashboard looks for Prometheus)."""

    cluster: Any
    token: str
    temp_dir: str
    prometheus_port: int
    named: dict[str, Any] = field(default_factory=dict)
    added: list[Any] = field(default_factory=list)  # nodes tests added (`add`), beyond the session's three
    node_dirs: list[str] = field(default_factory=list)  # the worker nodes' temporary directories, removed at the end

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def dashboard(self) -> str:
        return f"http://{self.cluster.webui_url}"

    @classmethod
    @contextmanager
    def start(cls) -> Iterator[Nodes]:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]
        from ray.cluster_utils import Cluster

        from distrl.cluster.backend import loopback_cluster

        temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # Ray's socket paths must fit in 107 bytes
        prometheus_port = free_port()
        saved = os.environ.get("RAY_PROMETHEUS_HOST")
        os.environ["RAY_PROMETHEUS_HOST"] = f"http://127.0.0.1:{prometheus_port}"  # read when the dashboard starts
        cluster = nodes = None
        try:
            with loopback_cluster() as token_file:
                # Ray's own test helper starts the nodes without turning token auth on (ray.init does, ray start
                # does only when told): the session's nodes and every client here ask for it.
                os.environ["RAY_AUTH_MODE"] = "token"
                Config.initialize("")  # this process's Ray reads its settings once: again, with the mode
                AuthenticationTokenLoader.instance().reset_cache()
                token = os.environ.get("RAY_AUTH_TOKEN") or (token_file or _user_token()).read_text().strip()
                try:  # stopped while the token and the environment it was started with are still there
                    head = LAYOUT["head"]
                    cluster = Cluster(initialize_head=True, head_node_args={
                        **head, "labels": {"pool": "head"}, "node_ip_address": "127.0.0.1", "temp_dir": temp_dir,
                        "include_dashboard": True, "dashboard_host": "127.0.0.1", "dashboard_port": free_port(),
                        "object_store_memory": 300 * 2**20})
                    nodes = cls(cluster, token, temp_dir, prometheus_port)
                    nodes.named["head"] = cluster.head_node
                    for name, args in LAYOUT.items():
                        if name != "head":
                            nodes.named[name] = nodes.add(labels={"pool": name}, **args)
                    nodes.added.clear()  # the session's own nodes stay
                    yield nodes
                finally:
                    if cluster is not None:
                        cluster.shutdown()
        finally:
            if saved is None:
                os.environ.pop("RAY_PROMETHEUS_HOST", None)
            else:
                os.environ["RAY_PROMETHEUS_HOST"] = saved
            Config.initialize("")  # back to the settings of the environment loopback_cluster restored
            for directory in [temp_dir, *(nodes.node_dirs if nodes is not None else [])]:
                shutil.rmtree(directory, ignore_errors=True)

    def add(self, *, labels: dict[str, str], num_cpus: float = 1, resources: dict[str, float] | None = None) -> Any:
        """Start one more worker node with `labels`, `num_cpus` and custom `resources`; returns once it is alive.
        The test that adds it removes it when done (`remove_added`)."""
        self.node_dirs.append(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        node = self.cluster.add_node(num_cpus=num_cpus, labels=labels, resources=resources or {},
                                     node_ip_address="127.0.0.1", object_store_memory=150 * 2**20,
                                     temp_dir=self.node_dirs[-1])
        self.added.append(node)
        return node

    def remove_added(self) -> None:
        """Remove the nodes tests added that are still there (not lost): later tests meet the session's three."""
        for node in self.added:
            if node in self.cluster.worker_nodes:
                self.cluster.remove_node(node)
        self.added.clear()

    def lose(self, node: Any) -> float:
        """Lose worker node `node` as a real node is lost: its raylet and every process under it (the actors' and
        tasks' workers, its agents) killed at once, without a word to the GCS. Returns when it was killed
        (time.monotonic())."""
        import psutil

        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        doomed = [raylet, *raylet.children(recursive=True)]
        doomed += [psutil.Process(p.process.pid) for procs in node.all_processes.values() for p in procs
                   if p.process.poll() is None and p.process.pid != raylet.pid]
        killed = time.monotonic()
        for process in doomed:
            with suppress(psutil.NoSuchProcess):
                process.kill()
        psutil.wait_procs(doomed, timeout=30)
        for procs in node.all_processes.values():  # reap the children this process started
            for p in procs:
                p.process.wait(timeout=30)
        self.cluster.worker_nodes.discard(node)  # nothing left for the session's shutdown to stop
        return killed


def _user_token() -> Path:
    """The token the session's cluster uses when the user has one of their own (loopback_cluster makes none)."""
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    return Path(path) if path else Path.home() / ".ray" / "auth_token"


def driver_env(nodes: Nodes) -> dict[str, str]:
    """The environment of a `distrl train` process that joins the session's cluster as a user's driver would: this
    interpreter's bin first on PATH, the repository importable, the cluster's token."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(ROOT),
               RAY_AUTH_TOKEN=nodes.token, RAY_AUTH_MODE="token")
    return env


def joined(nodes: Nodes, tmp_path: Path, *settings: str, model: Path | None = None) -> subprocess.Popen:
    """`distrl train` on the quickstart joining the session's cluster (`cluster.address`), writing into tmp_path,
    the model at `model` (default: tmp_path/../tiny-model, built there if missing). Output goes to
    tmp_path/driver.log."""
    env = driver_env(nodes)
    args = [f"run.output_dir={tmp_path}", f"model.path={model or tmp_path.parent / 'tiny-model'}", "run.progress=false",
            "eval=null", f"cluster.address={nodes.address}", *settings]
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           *(a for s in args for a in ("--set", s))]
    with (tmp_path / "driver.log").open("w") as log:  # the child holds its own copy of the file
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


class Watch:
    """A running driver's metrics rows and log, waited on with a deadline (the driver killed if it passes)."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path):
        self.proc, self.metrics, self.log = proc, run_dir / "metrics.jsonl", run_dir.parent / "driver.log"

    def rows(self) -> list[dict]:
        """The rows logged so far (a line still being written is left for the next look)."""
        text = self.metrics.read_text() if self.metrics.exists() else ""
        return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]

    def until(self, what: str, ready, within_s: float = 240.0) -> list[dict]:
        deadline = time.monotonic() + within_s
        while not ready(rows := self.rows()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError(f"{what}: not within {within_s:g} s (exit {self.proc.poll()}):\n"
                                     f"{self.log.read_text()[-4000:]}")
            time.sleep(0.2)
        return rows

    def stop(self) -> str:
        """SIGTERM: the driver finishes its step, checkpoints, releases every actor; returns its log."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=120)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        return self.log.read_text()


def actors_of(run: str) -> dict[str, dict]:
    """Every actor the run named (`distrl/<run>/...`), dead ones too: name -> Ray's state of it (node_id, state)."""
    from ray.util.state import list_actors

    return {a.name: {"node_id": a.node_id, "state": a.state}
            for a in list_actors(detail=True, limit=10_000, raise_on_missing_output=False)
            if a.name and a.name.startswith(f"distrl/{run}/")}


def leftovers(run: str, within_s: float = 30.0) -> tuple[list[str], list[str]]:
    """(the run's actors still alive, its placement groups not removed), once there are none or `within_s` has
    passed: Ray ends actors and removes placement groups asynchronously. `run` must name this test's run alone."""
    import ray

    deadline = time.monotonic() + within_s
    while True:
        alive = [name for name, a in actors_of(run).items() if a["state"] != "DEAD"]
        groups = [g["name"] for g in ray.util.placement_group_table().values()
                  if g["name"].startswith(f"distrl/{run}/") and g["state"] != "REMOVED"]
        if not (alive or groups) or time.monotonic() > deadline:
            return alive, groups
        time.sleep(0.5)
