"""Weight export from a sharded model: full tensors, bucket by bucket, every rank taking part.

The bucket layout is `distrl.workers.weights.export.specs` (full shapes, no communication); `gather_bucket` all-gathers
one bucket's tensors (a collective: every rank calls it with the same bucket) and returns them, cast, on rank 0
only. No rank holds more than one gathered bucket: on gloo every collective blocks its caller, and on CUDA, where
`full_tensor` only queues the all-gather, every rank waits for its bucket's gathers before returning
(`bound_run_ahead`). Without that, ranks other than 0, which never touch what they gather, would queue the
gathers of every bucket at once while rank 0 sends or writes one bucket at a time, each output held until its
collective ends: up to the whole model on each of them. The state dict's names are the HF checkpoint's: FSDP2
does not rename parameters, and a tied LM head appears under both names, as vLLM expects.

`local_pieces` is the other way, without a collective: each rank's own rows of a bucket's tensors (a `Shard(0)`
block), which it sends itself (`distrl.workers.weights.pieces`); an engine assembles the full tensors.

`save_hf` writes an HF folder (config + sharded safetensors + index) from the same buckets, leaving out tied aliases
and reverting transformers' weight conversions as `save_pretrained` does, so that `from_pretrained` and vLLM load it
directly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distrl.workers.training.sharding.load import aliases
from distrl.workers.training.sharding.wrap import own_rows
from distrl.workers.weights import export
from distrl.workers.weights.export import Bucket, Spec
from distrl.workers.weights.pieces import Pieces


@torch.no_grad()
def gather_bucket(model: torch.nn.Module, spec: Spec, dtype: torch.dtype, device: str | torch.device = "cpu",
                  every_rank: bool = False) -> dict[str, torch.Tensor] | None:
    """The full tensors of bucket `spec`, cast to `dtype`, contiguous on `device`, on rank 0 (on every rank with
    `every_rank`); None on the other ranks. Every rank must call it with the same `spec`; each returns once its part
    of the bucket's gathers is done (`bound_run_ahead`).

    Each shard is cast to `dtype` before it is gathered, not after: the cast is elementwise, so gathering the cast
    shards gives exactly the cast of the gathered tensor, and in the lower precision of the two (the export dtype,
    e.g. the engines' bfloat16, is never finer than the float32 master weights) the gather moves and holds half the
    bytes. (The training compute dtype would not do: with float32 engines and bfloat16 compute it would round
    weights the export must send exactly.)"""
    state = export.state(model)  # the model's own tensors, or its adapted blocks merged (learner.lora)
    rank0 = every_rank or not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    mesh_device = None
    for name, _ in spec:
        tensor = state[name]
        if isinstance(tensor, DTensor):
            mesh_device = tensor.device_mesh.device_type
            shard = cast(DTensor, tensor.to(dtype))  # this rank's shard, cast where it is (on the CPU when offloaded)
            if shard.device.type != mesh_device:  # CPU-offloaded shards of a GPU mesh
                shard = cast(DTensor, shard.to(mesh_device))
            tensor = shard.full_tensor()
        if rank0:
            out[name] = tensor.to(device, dtype).contiguous()
    if mesh_device is not None:
        bound_run_ahead(mesh_device)
    return out if rank0 else None


@torch.no_grad()
def local_pieces(model: torch.nn.Module, spec: Spec, dtype: torch.dtype) -> Pieces:
    """This rank's own rows of bucket `spec`'s tensors, cast to `dtype`, contiguous on the CPU, with the index of
    the first of them (`Pieces`); no collective. A tensor held whole on every rank (not sharded), or a block held on
    several (replicated over a mesh dimension), is sent by the first of its holders only, so that the ranks' pieces
    tile every tensor once."""
    state = export.state(model)  # the model's own tensors, or its adapted blocks merged (learner.lora)
    out = Pieces(Bucket(), {})
    for name, _ in spec:
        tensor = state[name]
        block, start, sends = own_rows(tensor)
        if sends and block.numel():
            out.tensors[name] = block.detach().to("cpu", dtype).contiguous()
            out.rows[name] = start
    return out


def bound_run_ahead(device_type: str) -> None:
    """Return once this rank's collectives queued on `device_type` are done: on CUDA, the current stream (which
    `full_tensor`'s all-gathers make wait for their NCCL work) is synchronised, so a rank queues one bucket's
    gathers at a time and holds at most one bucket of their outputs; on the CPU, gloo's collectives have already
    returned done."""
    if device_type == "cuda":
        torch.cuda.current_stream().synchronize()


def save_hf(model: torch.nn.Module, directory: str | Path, dtype: torch.dtype = torch.float32,
            bucket_bytes: int = 2**30) -> None:
    """Write `model` as an HF folder to `directory` from rank 0, gathering one bucket (one safetensors file) at a
    time; every rank must call it. Tied aliases and non-persistent buffers are left out, as `save_pretrained` does."""
    from safetensors.torch import save_file

    out = Path(directory)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    tied = aliases(model)
    specs = [[(n, s) for n, s in spec if n not in tied] for spec in export.specs(model, bucket_bytes, dtype)]
    specs = [spec for spec in specs if spec]
    weight_map: dict[str, str] = {}
    total = 0
    if rank0:
        out.mkdir(parents=True, exist_ok=True)
        config = copy.deepcopy(model.config)
        config.dtype = dtype  # what the files hold, so from_pretrained(dtype="auto") and vLLM take that dtype
        config.save_pretrained(out)  # type: ignore[union-attr,operator]  # a PreTrainedModel's config
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(out)
    for i, spec in enumerate(specs, start=1):
        bucket = gather_bucket(model, spec, dtype)
        if bucket is not None:
            bucket = checkpoint_layout(model, bucket)
            file = f"model-{i:05d}-of-{len(specs):05d}.safetensors"
            save_file(bucket, out / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(bucket, file))
            total += sum(t.numel() * t.element_size() for t in bucket.values())
    if rank0:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    if dist.is_initialized():
        dist.barrier()  # the folder is complete when save_hf returns on any rank


def checkpoint_layout(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (state-dict names) as `save_pretrained` writes them: transformers' conversions reverted (a mixture of
    experts' stacks `mlp.experts.gate_up_proj` back to each expert's `gate_proj` and `up_proj`, Mixtral's `mlp` to
    `block_sparse_moe`), so that the folder is the checkpoint layout vLLM's loaders expect; each tensor its own copy
    (safetensors refuses views of one storage). A model without conversions keeps its names."""
    from transformers.core_model_loading import revert_weight_conversion

    reverted = revert_weight_conversion(model, tensors)  # type: ignore[arg-type]  # a PreTrainedModel
    return tensors if reverted is tensors else {name: t.clone() for name, t in reverted.items()}
