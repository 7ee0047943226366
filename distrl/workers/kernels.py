"""Fused kernels for the model's elementwise work (`learner.kernels`, `critic.kernels`, `reference.kernels`).

Most of a small model's GPU time goes to elementwise kernels, not matrix products: RMSNorm, rotary embeddings and
SwiGLU each run as several kernels that read and write the activations (on one H200, the 0.5B learner step spent
28-33% of its GPU time in `mm`, and 16% in `copy_` alone). Two maintained ways to fuse them:

    liger    liger-kernel's Triton kernels put in place of the model's RMSNorm, rotary embedding and SwiGLU MLP
             (`_apply_liger_kernel_to_instance`: the model's own modules patched, weights and names unchanged;
             the rotary function is patched in transformers' modelling module, so for every model of that type in
             the process). The LM head stays distrl's chunked `linear_logprobs`, which also gives the entropy.
             Needs CUDA and the `kernels` extra (`pip install 'distrl[kernels]'`; the `gpu` extra includes it).
    compile  `torch.compile` of each decoder layer's forward (dynamic shapes: a packed row's length changes every
             micro-batch), distrl's packed attention left out of the graph (`torch.compiler.disable`: its Python
             bookkeeping would make a graph per pack). The first micro-batches pay the compilation.
    plain    the model as transformers writes it; the CPU default, and the reference the others are tested against.

Which is fastest depends on the model and the device: `bench/bench_gpu_step.py --kernels plain,liger,compile`
measures them in one run (docs/learner-performance.md says how to choose).
"""

from __future__ import annotations

from typing import Literal

import torch

Kernels = Literal["plain", "liger", "compile"]


def apply_kernels(model: torch.nn.Module, kernels: Kernels, device: str, field: str) -> torch.nn.Module:
    """`model` with the kernels `kernels` (`field` names the config field, for errors); returns it."""
    if kernels == "plain":
        return model
    if torch.device(device).type != "cuda":
        raise ValueError(f"{field} '{kernels}' needs a GPU (its Triton kernels and compiled graphs are CUDA's), and "
                         f"this role runs on {device}: set {field}: plain, or give the role GPUs")
    if kernels == "liger":
        return _liger(model, field)
    return _compiled(model)


def _liger(model: torch.nn.Module, field: str) -> torch.nn.Module:
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as e:
        raise ValueError(f"{field} 'liger' needs liger-kernel, which this process cannot import ({e}): install "
                         f"distrl's `kernels` extra (`pip install 'distrl[kernels]'`), or set {field}: plain") from e
    base = getattr(model, "get_base_model", lambda: model)()  # a peft model's adapted model
    model_type = getattr(base.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        raise ValueError(f"{field} 'liger': liger-kernel has no kernels for model type {model_type!r}; set "
                         f"{field}: compile or plain")
    _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=False)
    return model


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    from transformers import AttentionInterface

    from distrl.workers.packed_attention import PACKED_ATTENTION, packed_attention

    AttentionInterface.register(PACKED_ATTENTION, torch.compiler.disable(packed_attention))
    for layer in decoder_layers(model):
        layer.forward = torch.compile(layer.forward, dynamic=True)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes its `_no_split_modules` names (a peft model's base
    names them), outermost first."""
    base = getattr(model, "get_base_model", lambda: model)()
    names = set(getattr(model, "_no_split_modules", None) or ()) | set(getattr(base, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]
