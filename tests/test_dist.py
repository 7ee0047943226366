"""The learners' process group (`distrl.workers.dist`) in this process, a group of one: where it listens."""

from __future__ import annotations

import psutil

from distrl.workers.dist import free_port, init_process_group, leave_process_group


def listening() -> set[tuple[str, int]]:
    """(address, port) of this process's listening TCP sockets."""
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


def test_the_group_listens_on_its_master_address_only():
    """The store's server (rank 0) and gloo's own sockets are bound to 127.0.0.1, none to every interface (0.0.0.0
    or ::), as the embedded cluster, which runs on 127.0.0.1, keeps every server of its own."""
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
