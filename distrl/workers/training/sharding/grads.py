"""Global gradient-norm clipping over sharded (`DTensor`) or plain gradients, with the replica's norm."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm_(params: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients of `params` in place so that their global L2 norm is at most `max_norm` (`math.inf`:
    only measure); returns the norm before clipping (0-dim, on the gradients' device: reading it waits), the same
    number on every rank.

    For sharded gradients each rank's norm of its shards is a partial result; `full_tensor()` all-reduces it into
    sqrt(sum over ranks of squared norms), the norm of the whole gradient, which is what the replica computes.
    """
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        if total.device.type != total.device_mesh.device_type:  # CPU-offloaded gradients of a GPU mesh: NCCL reduces
            total = cast(DTensor, total.to(total.device_mesh.device_type))  # only device tensors (as gather_bucket)
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total
