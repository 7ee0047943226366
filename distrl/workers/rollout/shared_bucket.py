"""A bucket of weights that the worker processes of a tensor-parallel engine map instead of receiving a copy.

vLLM's own way into its worker processes (`collective_rpc` with the tensors as arguments) pickles every tensor to
every worker: each of k workers receives the whole bucket into its own memory only to keep its 1/k slice. Instead
the rollout actor writes the bucket once into an anonymous memory file (`memfd_create`) and hands the workers a
`SharedBucket`, a few hundred bytes naming the file and where each tensor lies in it. Each worker maps the file
read-only and gives vLLM's weight loaders views of it: a loader copies out only the slice its rank holds (the
narrowing vLLM's loaders do for a full checkpoint tensor), so each byte of a tensor is read by the workers that
serve it, and the file's pages are shared by all of them. The file is freed by the kernel once the actor has
closed it and the last worker's view of it is gone: nothing is left on disk or in /dev/shm, whoever dies.

Workers open the file through `/proc/<actor pid>/fd/<fd>`, which Linux allows a process of the same user (vLLM's
CPU and GPU workers are the actor's own children). Linux only, as vLLM's CPU build is.
"""

from __future__ import annotations

import mmap
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from distrl.workers.weights.export import Spec

ALIGN = 64
"""Byte alignment of each tensor in the file (a cache line; vLLM's loaders copy from these views)."""


@dataclass(frozen=True)
class SharedBucket:
    """Where a bucket's tensors lie: in the memory file `fd` of process `pid`, `size` bytes, each tensor (name,
    dtype name, shape) at its byte offset."""

    pid: int
    fd: int
    size: int
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of each tensor, read-only views of the mapped file (in a worker process)."""
        with open(f"/proc/{self.pid}/fd/{self.fd}", "rb") as file:
            mapped = mmap.mmap(file.fileno(), self.size, prot=mmap.PROT_READ)
        with warnings.catch_warnings():  # the mapping is read-only, and so are the views: loaders only copy them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(mapped, dtype=torch.uint8)
        for name, dtype, shape, offset in self.entries:
            item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            nbytes = item * torch.Size(shape).numel()
            yield name, raw[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)


class SharedMemory:
    """The rollout actor's side: a memory file laid out for one bucket, its tensors writable in this process
    (`tensors`), handed to the workers as `bucket`; `close` once every worker has taken its views."""

    def __init__(self, spec: Spec, dtype: torch.dtype):
        item = torch.empty((), dtype=dtype).element_size()
        entries, offset = [], 0
        for name, shape in spec:
            entries.append((name, str(dtype).removeprefix("torch."), tuple(shape), offset))
            offset += -(-item * torch.Size(shape).numel() // ALIGN) * ALIGN
        self.size = max(offset, ALIGN)
        self.fd = os.memfd_create("distrl-weights", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, self.size)
        self._mapped: mmap.mmap | None = mmap.mmap(self.fd, self.size)
        raw = torch.frombuffer(self._mapped, dtype=torch.uint8)
        self.tensors = {name: raw[off:off + item * torch.Size(shape).numel()].view(dtype).view(shape)
                        for name, _, shape, off in entries}
        self.bucket = SharedBucket(os.getpid(), self.fd, self.size, tuple(entries))

    def close(self) -> None:
        """Drop this process's file descriptor and its reference to the mapping, which is unmapped once no view of it
        is left here (never unmapped explicitly: `torch.frombuffer` views would then point at nothing). The workers'
        mappings keep the memory until theirs go."""
        self.tensors = {}
        self._mapped = None
        os.close(self.fd)


def allocate(opened: list[SharedMemory]):
    """An `Allocate` (`distrl.workers.weights.pieces`) that lays each bucket out in a new memory file, recorded in
    `opened` for the caller to close."""
    def into_shared_memory(spec: Spec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        opened.append(SharedMemory(spec, dtype))
        return opened[-1].tensors
    return into_shared_memory
