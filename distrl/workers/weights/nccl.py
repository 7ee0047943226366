"""NCCL weight broadcast between learner 0 and the rollout engines (GPU only).

A separate, stateless NCCL world (vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`) holds learner 0 as
rank 0 and rollout actor i as rank i + 1, so it never touches the learners' own torch.distributed group.
Tensors travel bucket by bucket: each bucket is flattened on learner 0, broadcast, and unflattened on every engine.
An engine receives a bucket only when its reload asks for the next one (`receive_buckets`), so one bucket at a
time sits on its device, not a copy of the model outside vLLM's memory budget.

Status: written against vLLM's public communicator API; not yet run on a GPU (see docs/verification.md).
Its bucket-by-bucket logic is tested on CPU with a fake communicator.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

Spec = list[tuple[str, tuple[int, ...]]]
"""One bucket's layout: (HF name, shape) of each tensor, in order."""


def make_communicator(host: str, port: int, rank: int, world_size: int, timeout_s: float):
    """This process's rank `rank` of the NCCL world of `world_size` ranks whose rendezvous (a TCPStore) rank 0
    serves on `host:port`; the store waits `timeout_s` for every rank to join (vLLM's own default is 300 s)."""
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                         store_timeout=math.ceil(timeout_s))
    return PyNcclCommunicator(group, device=torch.cuda.current_device())


def _stream(device: torch.device):
    """The stream a broadcast on `device` runs on: the current CUDA stream (None off CUDA, for test fakes)."""
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def send_bucket(comm, bucket: dict[str, torch.Tensor], device: torch.device | None = None) -> None:
    """Broadcast one bucket from rank 0: its tensors flattened into one `[sum of numels]` tensor on `device`."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    flat = torch.cat([t.reshape(-1) for t in bucket.values()]).to(device)
    stream = _stream(device)
    comm.broadcast(flat, src=0, stream=stream)
    if stream is not None:
        stream.synchronize()


def receive_bucket(comm, spec: Spec, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Receive one bucket laid out as `spec`: a `[sum of numels]` tensor in `dtype` on `device`, viewed as the
    bucket's named tensors (views, so the flat tensor lives as long as any of them)."""
    numels = [int(torch.Size(shape).numel()) for _, shape in spec]
    flat = torch.empty(sum(numels), dtype=dtype, device=device)
    stream = _stream(device)
    comm.broadcast(flat, src=0, stream=stream)
    if stream is not None:
        stream.synchronize()
    return {name: part.view(shape) for (name, shape), part in zip(spec, flat.split(numels), strict=True)}


def receive_buckets(comm, specs: list[Spec], dtype: torch.dtype, device: torch.device
                    ) -> Iterator[dict[str, torch.Tensor]]:
    """The buckets `specs`, each received when asked for: the consumer loads one before the next is allocated."""
    for spec in specs:
        yield receive_bucket(comm, spec, dtype, device)
