"""NCCL weight broadcast between learner 0 and the rollout engines (GPU only).

A separate, stateless NCCL world (vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`) holds learner 0 as
rank 0 and rollout actor i as rank i + 1, so it never touches the learners' own torch.distributed group.
Tensors travel bucket by bucket: each bucket is flattened on learner 0, broadcast, and unflattened on every engine.

Status: written against vLLM's public communicator API; not yet run on a GPU (see README, "What was verified where").
"""

from __future__ import annotations

import torch

Spec = list[tuple[str, tuple[int, ...]]]
"""One bucket's layout: (HF name, shape) of each tensor, in order."""


def make_communicator(host: str, port: int, rank: int, world_size: int):
    from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
    from vllm.distributed.utils import StatelessProcessGroup

    group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size)
    return PyNcclCommunicator(group, device=torch.cuda.current_device())


def send_bucket(comm, bucket: dict[str, torch.Tensor]) -> None:
    flat = torch.cat([t.reshape(-1) for t in bucket.values()]).cuda()
    comm.broadcast(flat, src=0, stream=torch.cuda.current_stream())
    torch.cuda.current_stream().synchronize()


def receive_bucket(comm, spec: Spec, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    numels = [int(torch.Size(shape).numel()) for _, shape in spec]
    flat = torch.empty(sum(numels), dtype=dtype, device="cuda")
    comm.broadcast(flat, src=0, stream=torch.cuda.current_stream())
    torch.cuda.current_stream().synchronize()
    return {name: part.view(shape) for (name, shape), part in zip(spec, flat.split(numels), strict=True)}
