"""`distrl.workers.training.optim`: where AdamW runs fused (`fused_on`): on CUDA, every trained parameter there in a
floating dtype; on the CPU, or with parameters offloaded to the CPU (FSDP's cpu_offload), torch's default. The fused
optimizer itself is checked on a GPU (tests/gpu/test_gpu_workers.py)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from distrl.config import LearnerConfig
from distrl.workers.training.optim import build_optimizer, fused_on


def param(device: str, floating: bool = True):
    """A parameter's device and dtype kind, as `fused_on` reads them (no CUDA tensor can be made here)."""
    return SimpleNamespace(device=torch.device(device), is_floating_point=lambda: floating)


def test_fused_on_cuda_with_every_parameter_there():
    assert fused_on("cuda", [param("cuda"), param("cuda:0")])
    assert not fused_on("cpu", [param("cpu")])
    assert not fused_on("cuda", [param("cuda"), param("cpu")])  # offloaded shards: torch's default
    assert not fused_on("cuda", [param("cuda", floating=False)])


def test_the_cpu_keeps_torchs_default_adamw():
    optimizer, _ = build_optimizer(torch.nn.Linear(2, 2), LearnerConfig(), total_steps=1)
    assert not optimizer.defaults["fused"]
