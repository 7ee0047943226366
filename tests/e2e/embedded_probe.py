"""Run by tests/e2e/test_embedded_cluster.py in a fresh process: start distrl's embedded cluster, run one task, and
print as JSON what it listens on, what the dashboard answers with and without the run's token, and where that
token was; then close it and say whether the token and the switch it set are gone."""

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


backend = RayBackend(ClusterConfig(num_cpus=1))
ray.get(ray.remote(pid).remote())  # a worker process, with its own servers
me = psutil.Process()
listening = sorted({(c.laddr.ip, p.name()) for p in (me, *me.children(recursive=True))
                    for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN})
token_path = os.environ.get("RAY_AUTH_TOKEN_PATH")
token = Path(token_path).read_text() if token_path else None
url = re.search(r"dashboard at (http://\S+)", backend.description)[1] + "/api/jobs/"
found = {"listening": listening, "description": backend.description, "token_path": token_path,
         "without_token": status(url, None), "with_token": status(url, token)}
backend.close()
found["token_left"] = bool(token_path and os.path.exists(token_path))
found["env_left"] = [k for k in ("RAY_AUTH_TOKEN_PATH", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE")
                     if k in os.environ]
print(json.dumps(found))
