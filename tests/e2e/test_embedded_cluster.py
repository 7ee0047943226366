"""The embedded cluster a plain `distrl train` starts is reachable from this machine only and guarded by a token
that lives as long as the run: every server Ray starts listens on 127.0.0.1 (the learners' process group too), the
dashboard refuses requests without the token, and nothing is written to HOME."""

import json
import subprocess
import sys

from .conftest import ROOT, cli_env

LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}


def test_the_embedded_cluster_listens_on_loopback_only_behind_a_token_of_its_own(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in cli_env().items() if k not in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")}
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "e2e" / "embedded_probe.py")], cwd=tmp_path,
                            env={**env, "HOME": str(home)}, capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    names = {name for _, name in found["listening"]}
    assert {"gcs_server", "raylet"} <= names, found["listening"]  # the servers were seen at all
    exposed = [(ip, name) for ip, name in found["listening"] if ip not in LOOPBACK]
    assert not exposed, f"listening beyond 127.0.0.1: {exposed}"
    group = found["group"]  # the learners' process group: rank 0's store and gloo's sockets, seen and on loopback
    assert ["127.0.0.1", group["port"]] in group["listening"], group
    assert {ip for ip, _ in group["listening"]} <= LOOPBACK, group
    assert found["without_token"] == 401 and found["with_token"] == 200
    assert found["token_path"] and f"its token is in {found['token_path']}" in found["description"]
    assert not found["token_left"] and not found["env_left"]
    assert not any(home.iterdir()), "the run wrote to HOME"
