"""The expert stacks of vLLM's CPU build, packed for its grouped GEMM: packed again after an in-place reload, and
read back unpacked. Runs inside the engine's workers.

The CPU build pads each layer's intermediate dimension to its kernel's alignment and packs every expert's block
(`cpu_prepack_moe_weight`: same shape, entries permuted) once, after the first load. vLLM 0.32's in-place reload
does not pack them again: the reloaded stacks stay in transformers' layout while the kernel reads them as packed
(measured on the tiny Qwen3-MoE: the served log-probs off by 0.28 after a push, and the fingerprint check failing on
every expert stack), so `pack_after_reload` runs the kernel's own packing step after each reload, as the first load
did.

`unpacked` undoes the packing: the permutation is read from the kernel's own packing of the positions themselves,
in base-256 digits so that each is exact in the weights' dtype (bfloat16 holds the integers to 256).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

DIGIT = 256
"""Base of the digits the packing's positions are read in: every integer below it is exact in bfloat16."""


def packing_kernel(module: Any) -> Any:
    """The CPU kernel that packs `module`'s expert stacks (a vLLM `RoutedExperts`), or None where they are held as
    transformers lays them out."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    kernel = getattr(getattr(module.quant_method, "moe_kernel", None), "fused_experts", None)
    packs = isinstance(kernel, CPUUnquantizedExperts) and not kernel._use_zentorch
    return kernel if packs else None


def pack_after_reload(model: torch.nn.Module) -> None:
    """Pack the expert stacks of every layer of `model` whose CPU kernel packs them, as after the first load."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    for module in model.modules():
        kernel = packing_kernel(module) if isinstance(module, RoutedExperts) else None
        if kernel is not None:
            kernel.process_weights_after_loading(module)


def unpacked(packed: torch.Tensor, isa: str) -> torch.Tensor:
    """`packed` (`[E, N, K]`, each expert's block packed by `cpu_prepack_moe_weight` for `isa`) in its original
    order."""
    experts, rows, cols = packed.shape
    source = _packing(rows, cols, packed.dtype, isa).to(packed.device)  # packed position -> original position
    out = torch.empty_like(packed).reshape(experts, rows * cols)
    out[:, source] = packed.reshape(experts, rows * cols)
    return out.reshape(experts, rows, cols)


@functools.lru_cache(maxsize=16)
def _packing(rows: int, cols: int, dtype: torch.dtype, isa: str) -> torch.Tensor:
    """`[rows * cols]`: for each position of one packed `[rows, cols]` expert block, the position it was packed from."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    positions = torch.arange(rows * cols)
    source = torch.zeros(rows * cols, dtype=torch.long)
    scale = 1
    while scale < rows * cols:
        digit = ((positions // scale) % DIGIT).to(dtype).reshape(1, rows, cols)
        source += cpu_prepack_moe_weight(digit, isa).reshape(-1).long() * scale
        scale *= DIGIT
    return source
