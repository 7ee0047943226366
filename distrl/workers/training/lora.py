"""The policy's low-rank adapters (`learner.lora`) on the learner's side, through `peft`: wrapping the base model,
the adapter tensors a push sends and a checkpoint keeps, and what the engines serve of them. Plain code, no Ray.

A LoRA layer computes W x + (alpha / r) B A dropout(x), with W frozen. The adapter tensors carry PEFT's names
(`base_model.model.<HF module>.lora_A.weight` `[r, in]`, `...lora_B.weight` `[out, r]`), the names vLLM's LoRA
loader parses. vLLM folds the scale into B when it loads an adapter (`LoRALayerWeights.optimize`: B *= alpha / r in
the served dtype), so what an engine multiplies by is `served_tensors`' B, not the learner's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from distrl.config import LoraConfig
from distrl.workers.training import moe

ADAPTER_DIR = "adapter"
"""The subdirectory of a checkpoint's policy part that holds the adapters in PEFT's format (`adapter_config.json`,
`adapter_model.safetensors`), in place of the full model's model/."""


EXPERTS_FUSED = ("in a mixture of experts transformers holds the experts' projections fused, as parameters "
                 "(mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]), not as the Linear modules that "
                 "target_modules adapts; peft reaches such parameters only through its target_parameters, whose "
                 "adapters distrl neither pushes into vLLM nor checks there: adapt the attention projections "
                 "(q_proj, k_proj, v_proj, o_proj)")
"""Why a mixture of experts' MLP projections take no adapters (transformers 5, peft 0.21)."""


def peft_config(cfg: LoraConfig) -> dict[str, Any]:
    """The adapters' PEFT `LoraConfig` as a dict (the keys `adapter_config.json` holds; vLLM's PEFTHelper reads it)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
            "lora_dropout": cfg.dropout, "target_modules": list(cfg.target_modules), "bias": "none",
            "use_rslora": False, "use_dora": False}


def wrap(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` with adapters on `cfg.target_modules` (peft's `get_peft_model`): A random (peft's Kaiming init, drawn
    from torch's seed, `torch.initial_seed()`), B zero, in float32 whatever the base's dtype; every base parameter
    frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    options = {k: v for k, v in peft_config(cfg).items() if k != "peft_type"}
    # A's random start depends on the run's seed alone, not on what loading the base drew before: every learner
    # (replicated or sharded) starts from the same adapters.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed())
        wrapped = get_peft_model(model, PeftLoraConfig(**options), autocast_adapter_dtype=True)
    for name, param in wrapped.named_parameters():
        if param.requires_grad and "lora_" in name:
            param.data = param.data.float()  # master weights of what trains stay float32 (base in bf16 on GPUs)
    targeted = {name.rpartition(".")[2] for name, module in wrapped.named_modules() if hasattr(module, "lora_A")}
    missing = [m for m in cfg.target_modules if m not in targeted]
    if missing and moe.routers(model):
        raise ValueError(f"learner.lora.target_modules {missing}: {EXPERTS_FUSED}")
    if missing:
        raise ValueError(f"learner.lora.target_modules {missing}: the model has no such projections")
    return wrapped


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` carries peft adapters (`wrap`)."""
    from peft import PeftModel

    return isinstance(model, PeftModel)


def adapter_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, tensor) of every adapter tensor of `model`, in a fixed order: what a push sends."""
    from peft import get_peft_model_state_dict

    yield from get_peft_model_state_dict(model).items()


def served_tensors(named: Iterator[tuple[str, torch.Tensor]], dtype: torch.dtype,
                   scaling: float) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapter tensors as a vLLM engine holds them once loaded in `dtype`: A cast, B cast then multiplied in
    place by `scaling` (alpha / r) in that dtype, as `LoRALayerWeights.optimize` does, so that both sides'
    fingerprints agree bit for bit."""
    for name, tensor in named:
        cast = tensor.detach().to("cpu", dtype)
        if ".lora_B." in name and scaling != 1:
            cast = cast.clone()
            cast *= scaling
        yield name, cast


@torch.no_grad()
def load_adapter(directory: str | Path, model: torch.nn.Module) -> None:
    """Load the adapters PEFT's `save_pretrained` wrote in `directory` into `model`, which must have exactly those
    adapters (same modules, same rank)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(Path(directory) / "adapter_model.safetensors"))
    ours = dict(adapter_tensors(model))
    if set(state) != set(ours) or any(state[k].shape != ours[k].shape for k in ours):
        raise RuntimeError(f"adapters in {directory} do not match learner.lora: saved {len(state)} tensors "
                           f"(e.g. {next(iter(sorted(state)), None)}), the model has {len(ours)} "
                           f"(e.g. {next(iter(sorted(ours)), None)})")
    set_peft_model_state_dict(model, state)
