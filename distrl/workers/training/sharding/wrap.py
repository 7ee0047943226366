"""`shard`: apply FSDP2 (`fully_shard`) to an HF causal LM, one unit per decoder layer and one at the root;
`own_rows`: the block of a sharded weight this rank holds (what it loads, and what it sends in a push).

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
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor


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


def own_rows(tensor: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """This rank's block of `tensor` (a DTensor sharded on dimension 0 only, or a plain tensor every rank holds
    whole), the index of its first row, and whether this rank is the one that sends it (the first along every
    mesh dimension the block is replicated over; rank 0 for a plain tensor)."""
    if not isinstance(tensor, DTensor):
        return tensor, 0, not dist.is_initialized() or dist.get_rank() == 0
    # A private helper of torch's, the one DTensor itself uses to place a rank's shard (uneven shards included).
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh, placements = tensor.device_mesh, tensor.placements
    if any(isinstance(p, Shard) and p.dim != 0 for p in placements):
        raise ValueError(f"a weight sharded on dimension {[p for p in placements if isinstance(p, Shard)]} cannot be "
                         f"sent as blocks of rows")
    _, offset = compute_local_shape_and_global_offset(tensor.shape, mesh, placements)
    sends = all(mesh.get_local_rank(d) == 0 for d, p in enumerate(placements) if isinstance(p, Replicate))
    return tensor.to_local(), (offset[0] if offset else 0), sends
