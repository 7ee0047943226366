"""Run by tests/e2e/test_embedded_cluster.py in a fresh process: start distrl's embedded cluster, run one task, join
two actors in a learners' process group, and print as JSON what it listens on (the group's members apart too), what
the dashboard answers with and without the run's token, and where that token was; then close it and say whether the
token and the switch it set are gone."""

import json
import os
import re
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import ray

from distrl.cluster.backend import RayBackend
from distrl.config import ClusterConfig


def status(url: str, token: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as err:
        return err.code


def pid() -> int:
    return os.getpid()


@ray.remote(num_cpus=0)
class Member:
    """A learner's part of the learners' process group (`distrl.workers.training.dist`), without a model."""

    def free_port(self) -> tuple[str, int]:
        from distrl.workers.training import dist

        host = ray.util.get_node_ip_address()
        return host, dist.free_port(host)

    def join(self, host: str, port: int, rank: int, world_size: int) -> int:
        from distrl.workers.training import dist

        dist.init_process_group(host, port, rank, world_size, "cpu")
        return os.getpid()


def listening_sockets(process: psutil.Process) -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in process.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


backend = RayBackend(ClusterConfig(num_cpus=1))
ray.get(ray.remote(pid).remote())  # a worker process, with its own servers
members = [Member.remote() for _ in range(2)]
host, port = ray.get(members[0].free_port.remote())
member_pids = ray.get([m.join.remote(host, port, rank, len(members)) for rank, m in enumerate(members)])
me = psutil.Process()
listening = sorted({(ip, p.name()) for p in (me, *me.children(recursive=True)) for ip, _ in listening_sockets(p)})
group = {"port": port, "listening": sorted(s for pid in member_pids for s in listening_sockets(psutil.Process(pid)))}
token_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
token = Path(token_path).read_text() if token_path else None
url = re.search(r"dashboard at (http://\S+)", backend.description)[1] + "/api/jobs/"
found = {"listening": listening, "group": group, "description": backend.description, "token_path": token_path,
         "without_token": status(url, None), "with_token": status(url, token)}
backend.close()
found["token_left"] = bool(token_path and os.path.exists(token_path))
found["env_left"] = [k for k in ("RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")
                     if k in os.environ]
print(json.dumps(found))
