"""Connecting to Ray: an embedded local cluster by default, or an existing one (Ray job, `auto`, `ray://`).

The embedded cluster binds to 127.0.0.1 and keeps its dashboard there unless `cluster.dashboard_host` says
otherwise; Ray's token authentication stays at its default (on for new local clusters).
"""

from __future__ import annotations

import os

import ray

from distrl.config import ClusterConfig


class Connection:
    """Ray, connected for the length of a run; `close()` shuts down only what `connect` itself started."""

    def __init__(self, cfg: ClusterConfig):
        address = cfg.address or os.environ.get("RAY_ADDRESS")
        self.owned = not ray.is_initialized()
        if not self.owned:
            self.description = "ray: using the session already initialised in this process"
        elif address:
            ray.init(address=address)
            self.description = f"ray: joined {address}"
        else:
            # address="local": a new cluster of our own even when `ray start` left one running on this machine
            # (without it Ray joins that one and refuses num_cpus).
            ctx = ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=True,
                           dashboard_host=cfg.dashboard_host, _node_ip_address="127.0.0.1")
            self.description = f"ray: embedded cluster, dashboard at http://{ctx.dashboard_url or 'unavailable'}"

    def close(self) -> None:
        if self.owned and ray.is_initialized():
            ray.shutdown()
