"""The learners' process group (`distrl.workers.dist`) in this process, a group of one: where it listens."""

from __future__ import annotations

import os

import psutil

from distrl.workers.dist import free_port, gloo_bound_to, init_process_group, interface_towards, leave_process_group


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
