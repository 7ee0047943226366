"""Mixed precision for a replicated model: float32 master weights cast to the compute dtype once per forward pass,
one decoder layer at a time, the way FSDP2's `MixedPrecisionPolicy` casts a sharded model's (without the sharding).

Under `torch.autocast` the float32 weights stay float32 in the model, so every op decides its own dtype: each
linear layer casts its weight (cached for the autocast region) and its input, RMSNorm's float32 weight turns the
residual stream into float32, and the next linear layer casts it back, several casts per layer in the forward pass
and again in the backward pass (on one H200, `copy_` alone was 16% of the learner's GPU time in 10,000 calls a
step). Here a forward pre-hook on each unit (each decoder layer, and the model itself for the weights outside the
layers: embeddings, final norm, head) puts compute-dtype copies of its float32 weights in their place for the
unit's forward pass, and a forward hook puts the weights back: the whole pass runs in the compute dtype, the casts
are made once, and their gradients flow back through the casts into the float32 weights' `.grad` (accumulated over
micro-batches in float32). A recomputed layer (gradient checkpointing) runs its hooks again, so it casts again.
Frozen float32 weights are cast too (they would meet compute-dtype inputs); weights already in the compute dtype (a
frozen LoRA base) are left alone; buffers (rotary frequencies) are not weights and keep their dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from distrl.workers.training.kernels import decoder_layers

Slot = tuple[torch.nn.Module, str, torch.nn.Parameter]
"""A weight: the module that holds it, its name there, the float32 master."""


class CastOncePerForward:
    """The hooks of the module docstring on `model`, casting to `dtype`; `remove()` takes them away."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self.dtype = dtype
        layers = decoder_layers(model)
        inside = {id(m) for layer in layers for m in layer.modules()}
        units = [(layer, list(_slots(layer.modules()))) for layer in layers]
        units.append((model, list(_slots(m for m in model.modules() if id(m) not in inside))))
        self._handles = []
        for unit, slots in units:
            casts = [slot for slot in slots if slot[2].is_floating_point() and slot[2].dtype != dtype]
            if casts:
                self._handles.append(unit.register_forward_pre_hook(self._casting(casts)))
                self._handles.append(unit.register_forward_hook(self._restoring(casts), always_call=True))

    def _casting(self, slots: list[Slot]):
        def hook(module, args):
            cast: dict[int, torch.Tensor] = {}  # a tied weight (embedding and head) is cast once
            for holder, name, master in slots:
                if id(master) not in cast:
                    cast[id(master)] = master.to(self.dtype)
                holder._parameters[name] = cast[id(master)]  # type: ignore[assignment]  # as functional_call does
        return hook

    @staticmethod
    def _restoring(slots: list[Slot]):
        def hook(module, args, output):
            for holder, name, master in slots:
                holder._parameters[name] = master
        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _slots(modules: Iterator[torch.nn.Module]) -> Iterator[Slot]:
    for module in modules:
        for name, param in module._parameters.items():
            if param is not None:
                yield module, name, param
