"""Buckets of weights that the worker processes of a tensor-parallel engine map instead of receiving a copy.

vLLM's own way into its worker processes (`collective_rpc` with the tensors as arguments) pickles every tensor to
every worker: each of k workers receives the whole bucket into its own memory only to keep its 1/k slice. Instead
the rollout actor writes each bucket once into an anonymous memory file (`memfd_create`, a *segment*) and hands the
workers a `SharedBucket`, a few hundred bytes naming the segment and where each tensor lies in it. Each worker maps
the segment read-only and gives vLLM's weight loaders views of it: a loader copies out only the slice its rank
holds (the narrowing vLLM's loaders do for a full checkpoint tensor), so each byte of a tensor is read by the
workers that serve it, and the segment's pages are shared by all of them.

The segments are a pool (`SharedPool`), kept for the engine's life and mapped once by each worker: a fresh segment
a bucket would cost the kernel's page allocation at every push (measured: most of a push into two workers). A
segment is written again only once no worker holds a view of what it held last: vLLM's layer-wise reload keeps a
layer's tensors until all of them are in, which may be after the next bucket's call, so after each load every
worker reports the segments it still holds views of (`held_segments`). The pool stays at the few segments a push
has in flight at once. Nothing is left on disk or in /dev/shm: the kernel frees a segment once the actor has closed
it and no process maps it, whoever dies.

Workers open a segment through `/proc/<actor pid>/fd/<fd>`, which Linux allows a process of the same user (vLLM's
CPU and GPU workers are the actor's own children). Linux only, as vLLM's CPU build is.
"""

from __future__ import annotations

import mmap
import os
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from distrl.workers.weights.export import Spec

ALIGN = 64
"""Byte alignment of each tensor in a segment (a cache line; vLLM's loaders copy from these views)."""


@dataclass(frozen=True)
class SharedBucket:
    """Where a bucket's tensors lie: in segment `segment`, the memory file `fd` of process `pid` (`size` bytes),
    each tensor (name, dtype name, shape) at its byte offset."""

    pid: int
    fd: int
    size: int
    segment: int
    entries: tuple[tuple[str, str, tuple[int, ...], int], ...]

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of each tensor, read-only views of the mapped segment (in a worker process)."""
        with warnings.catch_warnings():  # the mapping is read-only, and so are the views: loaders only copy them
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw = torch.frombuffer(_mapped(self), dtype=torch.uint8)
        _handed_out.setdefault(self.segment, []).append(StorageWeakRef(raw.untyped_storage()))
        for name, dtype, shape, offset in self.entries:
            item = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            nbytes = item * torch.Size(shape).numel()
            yield name, raw[offset:offset + nbytes].view(getattr(torch, dtype)).view(shape)


# In a worker process: each segment mapped once, and the storages of the views handed out of each.
_mappings: dict[tuple[int, int], mmap.mmap] = {}
_handed_out: dict[int, list[StorageWeakRef]] = {}


def _mapped(bucket: SharedBucket) -> mmap.mmap:
    key = (bucket.pid, bucket.fd)
    if key not in _mappings or len(_mappings[key]) < bucket.size:
        with open(f"/proc/{bucket.pid}/fd/{bucket.fd}", "rb") as file:
            _mappings[key] = mmap.mmap(file.fileno(), bucket.size, prot=mmap.PROT_READ)
    return _mappings[key]


def held_segments() -> list[int]:
    """In a worker process: the segments of which some view handed out is still alive (vLLM's reload holds it)."""
    for segment in list(_handed_out):
        _handed_out[segment] = [ref for ref in _handed_out[segment] if not ref.expired()]
        if not _handed_out[segment]:
            del _handed_out[segment]
    return sorted(_handed_out)


class Segment:
    """One memory file of the rollout actor's pool, `size` bytes, mapped here for writing."""

    def __init__(self, index: int, size: int):
        self.index, self.size = index, size
        self.fd = os.memfd_create(f"distrl-weights-{index}", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, size)
        self.mapped = mmap.mmap(self.fd, size)

    def close(self) -> None:
        """Drop this process's file descriptor (the mapping goes with the last view of it; the workers' with theirs:
        never unmapped explicitly, as `torch.frombuffer` views would then point at nothing)."""
        os.close(self.fd)


class SharedPool:
    """The rollout actor's segments. `allocate(spec, dtype)` (an `Allocate` of `distrl.workers.weights.pieces`) lays a
    bucket out in a segment no worker holds views of (a new one if none is free and large enough) and returns its
    tensors, writable here; `bucket` then describes it for the workers, and `held` takes their report."""

    def __init__(self):
        self.segments: list[Segment] = []
        self.busy: set[int] = set()
        self.bucket: SharedBucket | None = None
        weakref.finalize(self, _close_all, self.segments)

    def allocate(self, spec: Spec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        item = torch.empty((), dtype=dtype).element_size()
        entries, size = [], 0
        for name, shape in spec:
            entries.append((name, str(dtype).removeprefix("torch."), tuple(shape), size))
            size += -(-item * torch.Size(shape).numel() // ALIGN) * ALIGN
        size = max(size, ALIGN)
        free = [s for s in self.segments if s.index not in self.busy and s.size >= size]
        segment = min(free, key=lambda s: s.size) if free else self._grow(size)
        self.busy.add(segment.index)  # until the workers report otherwise
        self.bucket = SharedBucket(os.getpid(), segment.fd, segment.size, segment.index, tuple(entries))
        raw = torch.frombuffer(segment.mapped, dtype=torch.uint8)
        return {name: raw[off:off + item * torch.Size(shape).numel()].view(dtype).view(shape)
                for name, _, shape, off in entries}

    def held(self, segments: set[int]) -> None:
        """The segments some worker still holds views of (`held_segments` of each), which must not be written."""
        self.busy = set(segments)

    def _grow(self, size: int) -> Segment:
        # A new segment, rounded up to a MiB so that buckets of a little more fit it next time.
        self.segments.append(Segment(len(self.segments), -(-size // 2**20) * 2**20))
        return self.segments[-1]

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.segments)


def _close_all(segments: list[Segment]) -> None:
    for segment in segments:
        segment.close()
