"""The policy's low-rank adapters (`learner.lora`) on the learner's side, through `peft`: wrapping the base model,
the adapter tensors a push sends and a checkpoint keeps, and what the engines serve of them. Plain code, no Ray.

A LoRA layer computes W x + (alpha / r) B A dropout(x), with W frozen. The adapter tensors carry PEFT's names
(`base_model.model.<HF module>.lora_A.weight` `[r, in]`, `...lora_B.weight` `[out, r]`), the names vLLM's LoRA
loader parses. vLLM folds the scale into B when it loads an adapter (`LoRALayerWeights.optimize`: B *= alpha / r in
the served dtype), so what an engine multiplies by is `served_tensors`' B, not the learner's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from distrl.config import LoraConfig

ADAPTER_DIR = "adapter"
"""The subdirectory of a checkpoint's policy part that holds the adapters in PEFT's format (`adapter_config.json`,
`adapter_model.safetensors`), in place of the full model's model/."""


EXPERT_PARAMETERS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}
"""The experts' parameter each MLP projection name stands for on a mixture of experts: transformers 5 holds every
sparse layer's experts fused, as 3-D parameters of one module (`mlp.experts.gate_up_proj` `[E, 2I, H]`, `down_proj`
`[E, H, I]`), which peft adapts through `target_parameters` (its `ParamWrapper`), not as Linear modules."""

MERGED = "distrl_serves_merged"
"""The attribute `wrap` sets on a model whose adapters are served merged into their base (`learner.lora.serve`)."""


def peft_config(cfg: LoraConfig, target_parameters: list[str] | None = None) -> dict[str, Any]:
    """The adapters' PEFT `LoraConfig` as a dict (the keys `adapter_config.json` holds; vLLM's PEFTHelper reads it),
    with `target_parameters` (the experts' fused parameters, `expert_targets`) when there are any."""
    out = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank, "lora_alpha": cfg.alpha,
           "lora_dropout": cfg.dropout, "target_modules": list(cfg.target_modules), "bias": "none",
           "use_rslora": False, "use_dora": False}
    if target_parameters:
        out["target_parameters"] = list(target_parameters)
    return out


def expert_targets(model: torch.nn.Module, cfg: LoraConfig) -> list[str]:
    """peft's `target_parameters` for `cfg.target_modules` on `model`: `<module>.<parameter>` (e.g.
    `experts.gate_up_proj`, matched as a suffix in every layer) of the experts' fused 3-D parameters the MLP
    projections among the targets stand for (`EXPERT_PARAMETERS`); [] on a dense model. Raises ValueError, naming
    the fields, for what such adapters cannot be: served as adapters, given dropout, or on half of gate_up_proj."""
    wanted = {EXPERT_PARAMETERS[m] for m in cfg.target_modules if m in EXPERT_PARAMETERS}
    found = sorted({f"{name.rpartition('.')[2]}.{param}" for name, module in model.named_modules()
                    for param, tensor in module.named_parameters(recurse=False)
                    if param in wanted and tensor.dim() == 3})
    if not found:
        return []
    named = [m for m in cfg.target_modules if m in EXPERT_PARAMETERS]
    if cfg.serve != "merged":
        raise ValueError(f"learner.lora.target_modules {named} on a mixture of experts adapt its experts' fused "
                         f"parameters ({', '.join(found)}, through peft's target_parameters), whose adapters distrl "
                         f"neither registers in vLLM nor checks there: set learner.lora.serve 'merged', or adapt "
                         f"the attention projections alone (q_proj, k_proj, v_proj, o_proj)")
    if ("gate_proj" in cfg.target_modules) != ("up_proj" in cfg.target_modules):
        raise ValueError(f"learner.lora.target_modules {named}: a mixture of experts holds its experts' gate and up "
                         f"projections as one tensor (gate_up_proj), which one adapter adapts whole; name both "
                         f"gate_proj and up_proj, or neither")
    if cfg.dropout:
        raise ValueError(f"learner.lora.dropout {cfg.dropout} with adapters on a mixture of experts' experts "
                         f"(learner.lora.target_modules {named}): peft applies no dropout to a parameter's adapter; "
                         f"set it 0")
    return found


def wrap(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` with adapters on `cfg.target_modules` (peft's `get_peft_model`; on a mixture of experts its experts'
    fused parameters too, `expert_targets`): A random (peft's Kaiming init, drawn from torch's seed,
    `torch.initial_seed()`), B zero, in float32 whatever the base's dtype; every base parameter frozen."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    experts = expert_targets(model, cfg)
    options = {k: v for k, v in peft_config(cfg, experts).items() if k != "peft_type"}
    # A's random start depends on the run's seed alone, not on what loading the base drew before: every learner
    # (replicated or sharded) starts from the same adapters.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch.initial_seed())
        wrapped = get_peft_model(model, PeftLoraConfig(**options), autocast_adapter_dtype=True)
    for name, param in wrapped.named_parameters():
        if param.requires_grad and "lora_" in name:
            param.data = param.data.float()  # master weights of what trains stay float32 (base in bf16 on GPUs)
    targeted = {name.rpartition(".")[2] for name, module in wrapped.named_modules() if hasattr(module, "lora_A")}
    missing = [m for m in cfg.target_modules if m not in targeted and not (experts and m in EXPERT_PARAMETERS)]
    if missing:
        raise ValueError(f"learner.lora.target_modules {missing}: the model has no such projections")
    setattr(wrapped, MERGED, cfg.serve == "merged")
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


def serves_merged(model: torch.nn.Module) -> bool:
    """Whether `model`'s adapters are pushed merged into their base weights (`learner.lora.serve: merged`)."""
    return bool(getattr(model, MERGED, False))


def merged_rows(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float,
                start: int = 0) -> torch.Tensor:
    """W + s B A in float32 for the rows `start` .. `start + len(weight)` of a Linear's weight: `weight` those rows
    `[n, in]` (all of them, or the block a sharded learner holds), A `[r, in]`, B `[out, r]` whole (the adapters
    are replicated: B's matching rows make the block's update, with no gather)."""
    rows = lora_b[start:start + weight.shape[0]]
    return weight.float() + scaling * (rows.float() @ lora_a.float())


def merged_experts(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, experts: int,
                   start: int = 0) -> torch.Tensor:
    """W_e + s B_e A_e in float32 for the experts `start` .. `start + len(weight)` of a fused expert parameter:
    `weight` those experts `[n, out, in]`, A `[E r, in]` and B `[out, E r]` whole, in peft's `ParamWrapper` layout:
    expert e's A is rows e r .. e r + r - 1, its B the columns j E + e (j < r), i.e. A viewed `[E, r, in]` and B
    viewed `[out, r, E]` (peft's `get_delta_weight`: einsum "o r e, e r i -> e o i")."""
    end = start + weight.shape[0]
    a = lora_a.float().reshape(experts, -1, lora_a.shape[-1])[start:end]                    # [n, r, in]
    b = lora_b.float().reshape(lora_b.shape[0], -1, experts).permute(2, 0, 1)[start:end]    # [n, out, r]
    return weight.float() + scaling * (b @ a)


def _hf_name(name: str) -> str:
    """A parameter's name in the model peft wrapped, without peft's `base_layer` levels: its HF name."""
    return ".".join(part for part in name.split(".") if part != "base_layer")


class Merged(Mapping[str, torch.Tensor]):
    """What a push sends with `learner.lora.serve: merged`, by HF name, in state-dict order: every parameter of each
    block (an attention or MLP module, e.g. `model.layers.0.self_attn`) that holds an adapted projection, the adapted
    ones merged (W + s B A, float32; a fused expert parameter expert by expert) and the rest as they are. Whole
    blocks, because vLLM loads q/k/v, gate/up and an MoE's experts each as one layer, which a reload must fill
    completely. A base sharded over the learners (a DTensor of row blocks) gives a DTensor of the merged blocks, each
    learner merging its own rows. Each tensor is made when read."""

    def __init__(self, model: torch.nn.Module):
        from peft.tuners.lora.layer import LoraLayer, ParamWrapper

        base = model.get_base_model()  # type: ignore[operator]  # a PeftModel's own
        self.adapted: dict[str, tuple[Any, Any]] = {}  # HF name -> (its base weight, peft's layer)
        for name, module in base.named_modules():
            if isinstance(module, LoraLayer) and module.active_adapters[0] in module.lora_A:
                if isinstance(module, ParamWrapper):
                    self.adapted[f"{_hf_name(name)}.{module.parameter_name}"] = (module.get_param(), module)
                else:
                    self.adapted[f"{_hf_name(name)}.weight"] = (module.get_base_layer().weight, module)
        blocks = tuple({n.rpartition(".")[0].rpartition(".")[0] + "." for n in self.adapted})
        self.plain = {hf: p for n, p in base.named_parameters()
                      if "lora_" not in n and (hf := _hf_name(n)).startswith(blocks)}

    def __iter__(self) -> Iterator[str]:
        return iter(self.plain)

    def __len__(self) -> int:
        return len(self.plain)

    @torch.no_grad()
    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.adapted:
            return self.plain[name]
        from distrl.workers.training.sharding.wrap import own_rows

        weight: Any
        module: Any
        weight, module = self.adapted[name]
        adapter = module.active_adapters[0]
        block, start, _ = own_rows(weight)
        lora_a, lora_b = module.lora_A[adapter].weight, module.lora_B[adapter].weight
        scaling = module.scaling[adapter]
        if weight.dim() == 3:
            merged = merged_experts(block if module._did_swap_in_out_features else block.transpose(1, 2),
                                    lora_a, lora_b, scaling, module.num_experts, start)
            merged = merged if module._did_swap_in_out_features else merged.transpose(1, 2)
        else:
            merged = merged_rows(block, lora_a, lora_b, scaling, start)
        if block is weight:
            return merged
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(merged, weight.device_mesh, weight.placements, run_check=False,
                                  shape=weight.shape, stride=weight.stride())
