"""The learners' process group (`distrl.workers.training.dist`) in this process, a group of one: where it listens."""

from __future__ import annotations

import os
from datetime import timedelta

import psutil

from distrl.workers.training.dist import (
    free_port,
    gloo_bound_to,
    init_process_group,
    interface_towards,
    leave_process_group,
)


def listening() -> set[tuple[str, int]]:
    """(address, port) of this process's listening TCP sockets."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_the_group_listens_on_its_master_address_only(monkeypatch):
    """The store's server (rank 0) and gloo's own sockets are bound to 127.0.0.1, none to every interface (0.0.0.0
    or ::), as the embedded cluster, which runs on 127.0.0.1, keeps every server of its own."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    port = free_port("127.0.0.1")
    before = listening()
    init_process_group("127.0.0.1", port, 0, 1, "cpu")
    try:
        opened = listening() - before
    finally:
        leave_process_group()
    assert ("127.0.0.1", port) in opened, opened  # the store
    assert len(opened) >= 2, opened  # and gloo's transport
    assert {address for address, _ in opened} == {"127.0.0.1"}, opened
    assert listening() == before  # left: the store and gloo closed their sockets
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # set for the group's making only


def test_gloo_is_bound_to_the_interface_towards_the_master(monkeypatch):
    """Towards 127.0.0.1 the loopback interface (not the one the host name resolves to); a gloo interface of
    one's own is left alone."""
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert "127.0.0.1" in [a.address for a in psutil.net_if_addrs()[interface_towards("127.0.0.1")]]
    with gloo_bound_to("127.0.0.1"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == interface_towards("127.0.0.1")
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    with gloo_bound_to("127.0.0.1"):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


# ------------------------------------------------------------------------------------ timeout and device (N3, C1)
class Recorded:
    """Stands for a torch function: records each call's arguments (and what came before it, in `order`)."""

    def __init__(self, order: list[str], name: str, through=None):
        self.order, self.name, self.through, self.calls = order, name, through, []

    def __call__(self, *args, **kwargs):
        self.order.append(self.name)
        self.calls.append((args, kwargs))
        return self.through(*args, **kwargs) if self.through else None


def test_the_gloo_group_and_its_store_get_the_timeout_asked_for(monkeypatch):
    import torch.distributed

    order: list[str] = []
    joined = Recorded(order, "init", through=torch.distributed.init_process_group)
    monkeypatch.setattr(torch.distributed, "init_process_group", joined)
    set_device = Recorded(order, "set_device")
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    init_process_group("127.0.0.1", free_port("127.0.0.1"), 0, 1, "cpu", timeout_s=2100.0)
    try:
        (args, kwargs), = joined.calls
        assert args == ("gloo",) and kwargs["timeout"] == timedelta(seconds=2100)
        assert "device_id" not in kwargs and not set_device.calls  # no CUDA on the CPU
        assert kwargs["store"].timeout == timedelta(seconds=2100)  # the rendezvous waits as long
    finally:
        leave_process_group()


def test_on_the_gpu_the_device_is_set_and_named_before_the_nccl_group_forms(monkeypatch):
    """The CUDA branch, with torch's calls replaced (no GPU here): device 0 (the one GPU Ray grants the actor) is
    the process's device before `init_process_group`, which names it and gets the timeout; gloo's interface
    variable is left alone."""
    import torch.distributed

    from distrl.workers.training import dist as workers_dist

    order: list[str] = []
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    set_device = Recorded(order, "set_device")
    joined = Recorded(order, "init")
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.distributed, "init_process_group", joined)
    stores: list[tuple] = []
    monkeypatch.setattr(workers_dist, "rendezvous_store", lambda *args: stores.append(args) or "the store")
    assert init_process_group("10.0.0.1", 29500, 1, 4, "cuda", timeout_s=900.0) == "nccl"
    assert order == ["set_device", "init"]
    assert set_device.calls == [((0,), {})]
    (args, kwargs), = joined.calls
    assert args == ("nccl",)
    assert kwargs == {"store": "the store", "rank": 1, "world_size": 4, "timeout": timedelta(seconds=900),
                      "device_id": torch.device("cuda", 0)}
    assert stores == [("10.0.0.1", 29500, 1, 4, timedelta(seconds=900))]
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_the_roles_join_their_groups_with_a_timeout_above_the_push_deadline():
    """Every learner's `connect` is asked with `cluster.sync_timeout_s` + the margin: a sharded learner waits in
    the export's all-gather as long as learner 0's broadcast waits for the engines, and the push's own deadline
    (with the driver's error naming the engines) must come first."""
    from distrl.cluster import roles
    from distrl.config import Config

    cfg = Config.model_validate({"model": {"path": "m"}, "data": {"path": "d.jsonl"},
                                 "cluster": {"sync_timeout_s": 1200}})
    assert roles.group_timeout_s(cfg) == 1200 + roles.GROUP_TIMEOUT_MARGIN_S > 1200

    calls: list[tuple] = []

    class Group:
        def __len__(self) -> int:
            return 3

        def node_ip(self, i: int) -> str:
            return "10.0.0.7"

        def call(self, i: int, method, *args):
            calls.append((i, method, *args))
            return args

    class Backend:
        def answer(self, handles, what: str, timeout_s: float):
            return 29400 if "port" in what else handles

    roles._connect(Backend(), Group(), "learner", "free_port", "connect", 60.0, 1500.0)  # type: ignore[arg-type]
    assert calls == [(0, "free_port", "10.0.0.7"),
                           *[(i, "connect", "10.0.0.7", 29400, i, 3, 1500.0) for i in range(3)]]
