"""Fused kernels for the model's elementwise work (`learner.kernels`, `critic.kernels`, `reference.kernels`).

Most of a small model's GPU time goes to elementwise kernels, not matrix products: RMSNorm, rotary embeddings and
SwiGLU each run as several kernels that read and write the activations (on one H200, the 0.5B learner step spent
28-33% of its GPU time in `mm`, and 16% in `copy_` alone). Two maintained ways to fuse them:

    liger    liger-kernel's Triton kernels put in place of the model's RMSNorm, rotary embedding and SwiGLU MLP
             of this model alone (`confined`): liger's `_apply_liger_kernel_to_instance` patches the instance's
             modules (weights and names unchanged) but also transformers' modelling module (its RMSNorm and MLP
             classes, its rotary function) for every later model of the process; those module attributes are put
             back at once, and the instance's modules whose forward reads a replaced function (the attention's
             rotary embedding) get a forward of their own that reads liger's. So a plain model built after a liger
             one in the same process (a hybrid actor's `kernels: plain` reference, a benchmark's baseline) stays
             plain. The LM head stays distrl's chunked `linear_logprobs`, which also gives the entropy. Needs CUDA
             and the `kernels` extra (`pip install 'distrl[kernels]'`; the `gpu` extra includes it).
    compile  `torch.compile` of each decoder layer's forward (dynamic shapes: a packed row's length changes every
             micro-batch), distrl's packed attention left out of the graph (`torch.compiler.disable`: its Python
             bookkeeping would make a graph per pack). The first micro-batches pay the compilation.
    plain    the model as transformers writes it; the CPU default, and the reference the others are tested against.

Which is fastest depends on the model and the device: `bench/bench_gpu_step.py --kernels plain,liger,compile`
measures them in one run (docs/learner-performance.md says how to choose).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import torch

from distrl.config.learner import Kernels


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
    confined(lambda: _apply_liger_kernel_to_instance(model=base, rope=True, rms_norm=True, swiglu=True,
                                                     cross_entropy=False, fused_linear_cross_entropy=False), base)
    return model


def confined(patch: Callable[[], object], model: torch.nn.Module, package: str = "transformers") -> dict[str, dict]:
    """Run `patch`, a kernel library's patch of `model` that also replaces attributes of `package`'s modules
    (classes and functions in a modelling module, for every model of the process), with its effect confined to
    `model`: every attribute of a module of `package` that `patch` replaced is put back, and each submodule of
    `model` whose class's forward reads a replaced global gets, on the instance, a copy of that forward whose
    globals hold the replacements (one copy per function, shared by the layers). Replaced classes need nothing:
    they only matter when a model is built, and `patch` patched this model's own modules. Returns what was
    replaced, {module name: {attribute: replacement}}."""
    modules = {name: module for name, module in list(sys.modules.items())
               if (name == package or name.startswith(package + ".")) and module is not None}
    before = {name: dict(vars(module)) for name, module in modules.items()}
    try:
        patch()
    finally:
        replaced = _put_back(modules, before)
    by_globals = {id(vars(modules[name])): swaps for name, swaps in replaced.items()}
    copies: dict[int, types.FunctionType] = {}
    for module in model.modules():
        forward = type(module).forward
        swaps = by_globals.get(id(getattr(forward, "__globals__", None)))
        if (swaps is None or not isinstance(forward, types.FunctionType) or "forward" in vars(module)
                or not set(forward.__code__.co_names) & swaps.keys()):
            continue  # no replaced global read, or the patch gave this module a forward of its own
        if id(forward) not in copies:
            copies[id(forward)] = _with_globals(forward, swaps)
        module.forward = types.MethodType(copies[id(forward)], module)
    return replaced


def _put_back(modules: dict[str, types.ModuleType], before: dict[str, dict]) -> dict[str, dict]:
    """Restore the attributes of `modules` that changed since `before` (their namespaces then); returns the
    replacements, by module name. Attributes added meanwhile (submodules imported) stay."""
    replaced: dict[str, dict] = {}
    for name, module in modules.items():
        namespace = vars(module)
        swaps = {key: value for key, value in namespace.items()
                 if key in before[name] and value is not before[name][key]}
        for key in swaps:
            setattr(module, key, before[name][key])
        if swaps:
            replaced[name] = swaps
    return replaced


def _with_globals(function: types.FunctionType, swaps: dict) -> types.FunctionType:
    """A copy of `function` (same code, defaults and closure) that reads its module's globals with `swaps` in
    place."""
    copy = types.FunctionType(function.__code__, {**function.__globals__, **swaps}, function.__name__,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__qualname__, copy.__doc__ = function.__qualname__, function.__doc__
    return copy


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    from transformers import AttentionInterface

    from distrl.workers.training.packed_attention import PACKED_ATTENTION, packed_attention

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
