"""The device a worker computes on, from the GPUs its role was granted (`cluster.<role>.num_gpus`), never from what
the machine happens to have: a role given no GPU stays on the CPU on a GPU node (the cluster layer also hides the
GPUs from its process), and a role given a GPU that CUDA cannot use fails instead of training on the CPU."""

from __future__ import annotations

import os

import torch


def granted_device(num_gpus: float, role: str) -> str:
    """"cuda" for a worker of `role` granted `num_gpus` > 0 GPUs (Ray's CUDA_VISIBLE_DEVICES names them, so it is
    device 0 of the process), which must then work; "cpu" otherwise."""
    if num_gpus <= 0:
        return "cpu"
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"the {role} actor was granted {num_gpus:g} GPU (cluster.{role}.num_gpus) but CUDA does not work in its "
            f"process (torch {torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
            f"install a CUDA build of torch on that node, or set cluster.{role}.num_gpus to 0 to run it on CPU")
    return "cuda"


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`x` (a host tensor) on `device`; to a GPU through pinned memory with `non_blocking`, so that the host does not
    wait for the kernels queued before the copy (a copy from pageable memory waits for the stream to drain)."""
    if torch.device(device).type == "cpu" or x.device.type != "cpu":
        return x.to(device, non_blocking=True)
    return x.pin_memory().to(device, non_blocking=True)
