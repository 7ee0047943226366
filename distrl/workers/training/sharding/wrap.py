"""`shard`: apply FSDP2 (`fully_shard`) to an HF causal LM, one unit per decoder layer and one at the root.

Decoder layers are found generically through the model's `_no_split_modules` (the classes transformers itself never
splits across devices: `LlamaDecoderLayer`, `Qwen2DecoderLayer`, ...). The root unit holds what is left: token
embeddings, final norm and LM head; tied embeddings are one parameter there, so they stay tied.

Gradients are SUMMED across learners, as in `distrl.workers.training.dist`: every learner divides its partial loss by
the global token count, so the sum over learners is the full-batch gradient. FSDP's reduce-scatter averages by default
(divides by M); `set_gradient_divide_factor(1.0)` removes the division and `set_force_sum_reduction_for_comms(True)`
makes the collective a plain SUM (without it FSDP asks for `PREMUL_SUM(1.0)`, which gloo does not implement and which
NCCL only needs for a real factor).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard


def decoder_layer_classes(model: torch.nn.Module) -> tuple[type[torch.nn.Module], ...]:
    """The module classes named by `model._no_split_modules` that occur in `model` (at least one)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    if not found:
        raise ValueError(f"strategy 'fsdp' (learner.strategy or critic.strategy): {type(model).__name__} names no "
                         f"decoder-layer class in _no_split_modules ({sorted(names)}), so it cannot be sharded layer "
                         f"by layer")
    return found


def learner_mesh(device: str) -> DeviceMesh:
    """A 1-D mesh over every rank of the default process group (the learners'), on `device` ("cpu" or "cuda").

    The mesh does not hold the group: DTensor's sharding caches keep every mesh to the end of the process, and a
    group held there outlives `dist.leave_process_group` with its threads. Outside torch.compile (which distrl does
    not use) a mesh looks its group up by name in c10d's registry, which `destroy_process_group` empties; only
    compiled code reads the mesh's own `_pg_registry`."""
    mesh = init_device_mesh(device, (torch.distributed.get_world_size(),))
    mesh._pg_registry.clear()
    return mesh


def shard(model: torch.nn.Module, mesh: DeviceMesh, *, compute_dtype: torch.dtype = torch.float32,
          cpu_offload: bool = False) -> torch.nn.Module:
    """Shard `model` in place over `mesh` and return it (now also an `FSDPModule`).

    Parameters stay in their own dtype (float32 master weights); with `compute_dtype` bfloat16 the all-gathered
    copies used by forward and backward are bfloat16 and gradients are reduced in float32
    (`MixedPrecisionPolicy`). `cpu_offload` keeps sharded parameters, gradients and hence optimizer state in CPU
    memory, copied to the device for each unit's forward and backward. `model` may be on the meta device.
    """
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype if compute_dtype != torch.float32 else None,
                              reduce_dtype=torch.float32)
    # Pinned host memory needs a GPU driver; on a CPU mesh the "offload" is a no-op move and must not pin.
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    classes = decoder_layer_classes(model)
    for module in list(model.modules()):
        if isinstance(module, classes):
            fully_shard(module, mesh=mesh, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # per unit: the setters below are not recursive
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    return model


def sync_gradients(model: torch.nn.Module, enabled: bool) -> None:
    """Whether the next backward reduce-scatters gradients (True, FSDP's default) or accumulates them unsharded on
    each rank until a backward with sync on (False).

    Learners keep the default, a reduce-scatter after every micro-batch: off until the last micro-batch saves the
    other micro-batches' collectives, but every rank then holds a full-size float32 gradient between them, which is
    what sharding removes. On the CPU with gloo the saving did not show (`bench/bench_learner_memory.py`: 4
    micro-batches on 2 learners, interleaved, the step times overlapped); on GPUs the per-micro-batch
    reduce-scatter runs on its own stream, overlapped with the rest of the backward."""
    if not isinstance(model, FSDPModule):
        raise TypeError(f"sync_gradients: {type(model).__name__} is not sharded (call shard first)")
    model.set_requires_gradient_sync(enabled)
