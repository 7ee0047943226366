"""What one worker of a vLLM engine serves of a mixture-of-experts layer's experts, under the HF names of
transformers' expert stacks and the region of each this worker holds (see `served_weights`, whose `served` calls
this for each experts layer).

vLLM holds a layer's experts as transformers does: `w13_weight [E, 2I, H]` (each expert's gate projection's rows,
then its up projection's) and `w2_weight [E, H, I]`, the HF tensors `mlp.experts.gate_up_proj` and
`mlp.experts.down_proj`. At TP k each worker holds every expert's rank-r block of the intermediate dimension: in
`gate_up_proj` two blocks of rows of dimension 1 (`(1, r I/k, I/k)` of the gate half, `(1, I + r I/k, I/k)` of the up
half), in `down_proj` one block of dimension 2 (`(2, r I/k, I/k)`).

vLLM's CPU build pads the intermediate dimension to its kernel's alignment and packs each expert's block for its
grouped GEMM (`cpu_experts`): what is fingerprinted is what the kernel multiplies by, unpacked into transformers'
layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from distrl.workers.rollout import cpu_experts
from distrl.workers.weights.fingerprint import Region, sample


def is_experts(module: torch.nn.Module) -> bool:
    """Whether `module` is a vLLM mixture-of-experts layer's stack of experts."""
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    return isinstance(module, RoutedExperts)


def experts(module: Any, prefix: str) -> Iterator[tuple[str, Region, torch.Tensor]]:
    """(HF name, region, `[E, S]` sample) of the expert stacks `module` (at `prefix`) serves in this worker."""
    hf = prefix.removesuffix(".routed_experts")  # vLLM's MoE runner holds the experts one level down
    config = module.moe_config
    if getattr(module, "w13_bias", None) is not None or not hasattr(module, "w2_weight"):
        raise RuntimeError(f"{hf}: experts with biases or quantized weights: their per-worker fingerprint is not "
                           f"supported (cluster.verify_weights=false turns the check off)")
    if config.ep_size > 1:
        raise RuntimeError(f"{hf}: experts spread over an expert-parallel group of {config.ep_size}: their per-worker "
                           f"fingerprint is not supported (cluster.verify_weights=false turns the check off)")
    gate_up, down = kernel_layout_undone(module)
    size, tp, rank = config.intermediate_size_per_partition, config.tp_size, config.tp_rank
    if tp == 1:
        yield f"{hf}.gate_up_proj", None, sample(gate_up)
        yield f"{hf}.down_proj", None, sample(down)
        return
    yield f"{hf}.gate_up_proj", (1, rank * size, size), sample(gate_up[:, :size])
    yield f"{hf}.gate_up_proj", (1, tp * size + rank * size, size), sample(gate_up[:, size:])
    yield f"{hf}.down_proj", (2, rank * size, size), sample(down)


def kernel_layout_undone(module: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """This worker's `[E, 2 I/k, H]` and `[E, H, I/k]` blocks of the expert stacks as transformers lays them out,
    from what the layer's kernel multiplies by (on CPU: unpacked, and the padding of the intermediate dimension cut)."""
    w13, w2 = module.w13_weight.detach(), module.w2_weight.detach()
    kernel = cpu_experts.packing_kernel(module)
    if kernel is not None:
        w13, w2 = cpu_experts.unpacked(w13, kernel.isa), cpu_experts.unpacked(w2, kernel.isa)
    size, padded = module.moe_config.intermediate_size_per_partition, w2.shape[2]
    return torch.cat([w13[:, :size], w13[:, padded:padded + size]], dim=1), w2[:, :, :size]
