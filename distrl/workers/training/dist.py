"""torch.distributed helpers for data-parallel learners: the process group, summed gradients, global counts.

Gradients are SUMMED across learners, not averaged: every learner divides its partial loss by the *global*
token/sequence count (`distrl.algo` normalizers), so the sum over learners and micro-batches is exactly the
full-batch loss and its gradient.

With sequence parallelism (`learner.sequence_parallel_size` k) the M learners form a grid of M / k data-parallel
groups of k consecutive ranks (learner r is in group r // k, at place r % k): the k learners of a group share each
micro-batch (`distrl.workers.training.ulysses`), and hold its rows once between them. Counts of rows and tokens, and
figures summed over learners, are therefore summed over one learner per group (`data_group`: the learners at the
same place of every group), never over all M, which would count each token k times; gradients are still summed over
all M (each learner's is the gradient through its own slice of the tokens).
"""

from __future__ import annotations

import contextlib
import gc
import os
import socket
from collections.abc import Iterator
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from distrl.workers.training.ulysses import SequenceSplit


def init_process_group(master_addr: str, master_port: int, rank: int, world_size: int, device: str,
                       timeout_s: float = default_pg_timeout.total_seconds(), sequence_parallel: int = 1) -> str:
    """Join the learners' group (gloo for learners on the CPU, NCCL on the GPU), rendezvous at rank 0's store on
    `master_addr:master_port`; returns the backend.

    `timeout_s` bounds every collective of the group (and the rendezvous): a rank that waits longer for its peers
    fails instead (NCCL's watchdog aborts it). The cluster layer sets it above `cluster.sync_timeout_s`
    (`distrl.cluster.roles.group_timeout_s`): during an NCCL push the other learners wait in the export's
    all-gather while learner 0's broadcast waits for every engine to finish the chunk it runs, and torch's own
    default (10 minutes under NCCL) would abort them first.

    On the GPU the process's device is set and named (`device_id`) before the group forms: Ray makes the one GPU
    granted to the actor its device 0, so the NCCL communicator is made at once, for that device (connection
    problems surface here, not at the first collective), and the device mesh need not guess it.

    `sequence_parallel` k > 1 also makes the grid's groups (`make_grid`)."""
    if world_size % sequence_parallel:
        raise ValueError(f"sequence_parallel_size ({sequence_parallel}) must divide the group's {world_size} ranks "
                         f"(learner.sequence_parallel_size and cluster.learner.num_actors, or the critic's)")
    backend = "nccl" if device == "cuda" else "gloo"
    timeout = timedelta(seconds=timeout_s)
    store = rendezvous_store(master_addr, master_port, rank, world_size, timeout)
    if backend == "nccl":
        torch.cuda.set_device(0)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                                device_id=torch.device("cuda", 0))
        make_grid(sequence_parallel)
        return backend
    with gloo_bound_to(master_addr):
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        make_grid(sequence_parallel)
    return backend


_grid: dict[str, object] = {}
"""The data-parallel x sequence-parallel grid of the learners' group (`make_grid`): "size" k, "sequence" (this
learner's group of k) and "data" (the learners at its place in every group); empty without sequence parallelism."""


def make_grid(size: int) -> None:
    """Form the grid of groups of `size` consecutive ranks (module docstring); every rank calls it, after joining
    the default group (it makes every subgroup, in the same order everywhere, as `new_group` requires)."""
    _grid.clear()
    if size == 1:
        return
    world, me = dist.get_world_size(), dist.get_rank()
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= me < first + size:
            _grid["sequence"] = group
    for place in range(size):
        group = dist.new_group(list(range(place, world, size)))
        if place == me % size:
            _grid["data"] = group
    _grid["size"] = size


def sequence_parallel_size() -> int:
    """k: the learners that share each micro-batch (1 without sequence parallelism)."""
    size = _grid.get("size", 1)
    assert isinstance(size, int)
    return size


def sequence_group() -> dist.ProcessGroup | None:
    """This learner's group of k, which splits its micro-batches (None without sequence parallelism)."""
    return _grid.get("sequence")  # type: ignore[return-value]  # set by make_grid


def data_group() -> dist.ProcessGroup | None:
    """The learners at this learner's place in every group: one per data-parallel group (None: every learner)."""
    return _grid.get("data")  # type: ignore[return-value]  # set by make_grid


def sequence_split() -> SequenceSplit | None:
    """This learner's place in its group of k (`ulysses.SequenceSplit`), None without sequence parallelism."""
    size = sequence_parallel_size()
    return SequenceSplit(sequence_group(), size, rank() % size) if size > 1 else None


def data_parallel_size() -> int:
    """Data-parallel groups: the ways the batch's rows are split."""
    return world_size() // sequence_parallel_size()


@contextlib.contextmanager
def gloo_bound_to(master_addr: str) -> Iterator[None]:
    """Gloo groups made within listen on the interface this process reaches `master_addr` through
    (`GLOO_SOCKET_IFNAME`, read when a group is made), unless the variable is set already.

    Gloo otherwise binds the address the machine's host name resolves to, whatever address the cluster runs on: a
    LAN address for a cluster kept to 127.0.0.1, on a host whose name resolves to one."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        yield
        return
    os.environ["GLOO_SOCKET_IFNAME"] = interface_towards(master_addr)
    try:
        yield
    finally:
        del os.environ["GLOO_SOCKET_IFNAME"]


def interface_towards(address: str) -> str:
    """The name of the network interface holding the address this process reaches `address` from (the source
    address of the route to it: its own node's address, or 127.0.0.1 towards 127.0.0.1)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))  # UDP: chooses the route, sends nothing
        source = probe.getsockname()[0]
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == source for a in addresses):
            return name
    raise RuntimeError(f"learners' process group: no network interface holds {source}, the address this process "
                       f"reaches {address} from")


def rendezvous_store(master_addr: str, master_port: int, rank: int, world_size: int,
                     timeout: timedelta = default_pg_timeout) -> dist.TCPStore:
    """The group's key-value store: its server on rank 0, listening on `master_addr` only; a client elsewhere.

    A TCPStore server binds every interface whatever host it is given (and so does `init_method="tcp://..."`),
    which on a cluster kept to 127.0.0.1 would open the learners' rendezvous to the network. It takes over a
    socket bound beforehand instead (`master_listen_fd`). `timeout` bounds the wait for every rank to join and
    each of the store's operations."""
    if rank != 0:
        return dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    listening = socket.create_server((master_addr, master_port), family=family)
    # detach: the store owns the descriptor now and closes it; a Python socket object would close it again
    return dist.TCPStore(master_addr, master_port, world_size, is_master=True, timeout=timeout,
                         master_listen_fd=listening.detach())


def leave_process_group() -> None:
    """Leave the group and end its threads now (gloo's workers and TCP loop, the store's), while the interpreter runs.

    `destroy_process_group` only forgets the group: its C++ object, with gloo's worker threads, lives on while
    anything holds it, else to the end of the process. A worker that drops the last reference to a finished
    collective's tensors takes the GIL to free them; once the interpreter is finalizing, CPython ends such a thread
    with `pthread_exit`, whose unwinding through a noexcept destructor aborts the process ("terminate called without
    an active exception"). Collected here, the group's destructor joins its threads first. Call it once nothing else
    holds the group: the models sharded over it dropped (`Learner.close`). Without a group it only collects (one
    destroyed earlier may still be held by a model dropped since).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    _grid.clear()
    gc.collect()  # models and optimizers are reference cycles: the group goes with the last of them


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def free_port(host: str) -> int:
    """A free TCP port on `host` (the calling actor's node): the rendezvous of a process group."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank() -> int:
    """This learner's rank in the group (0 without one)."""
    return dist.get_rank() if dist.is_initialized() else 0


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """In-place all-reduce over `group` (default: every learner); a no-op with one learner."""
    if world_size() > 1:
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def all_reduce_grads_(params: list[torch.nn.Parameter], bucket_bytes: int = 32 * 2**20) -> None:
    """Sum `.grad` of `params` across learners, a bucket of flattened gradients per collective."""
    if world_size() == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    size = 0
    for g in [*grads, None]:
        if g is not None:
            bucket.append(g)
            size += g.numel() * g.element_size()
        if bucket and (g is None or size >= bucket_bytes):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = [], 0
