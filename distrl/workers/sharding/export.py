"""Weight export from a sharded model: full tensors, bucket by bucket, every rank taking part.

The bucket layout is `distrl.workers.export.specs` (full shapes, no communication); `gather_bucket` all-gathers
one bucket's tensors (a collective: every rank calls it with the same bucket) and returns them, cast
and on CPU, on rank 0 only. No rank ever holds more than one gathered bucket. The state dict's names are the HF
checkpoint's: FSDP2 does not rename parameters, and a tied LM head appears under both names, as vLLM expects.

`save_hf` writes an HF folder (config + sharded safetensors + index) from the same buckets, leaving out tied aliases
as `save_pretrained` does, so that `from_pretrained` and vLLM load it directly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distrl.workers import export
from distrl.workers.export import Spec
from distrl.workers.sharding.load import aliases


@torch.no_grad()
def gather_bucket(model: torch.nn.Module, spec: Spec, dtype: torch.dtype,
                  every_rank: bool = False) -> dict[str, torch.Tensor] | None:
    """The full tensors of bucket `spec`, cast to `dtype`, contiguous on CPU, on rank 0 (on every rank with
    `every_rank`); None on the other ranks. Every rank must call it with the same `spec`."""
    state = model.state_dict()
    rank0 = every_rank or not dist.is_initialized() or dist.get_rank() == 0
    out = {}
    for name, _ in spec:
        tensor = state[name]
        if isinstance(tensor, DTensor):
            if tensor.device.type != tensor.device_mesh.device_type:  # CPU-offloaded shards of a GPU mesh
                tensor = tensor.to(tensor.device_mesh.device_type)
            tensor = tensor.full_tensor()
        if rank0:
            out[name] = tensor.to("cpu", dtype).contiguous()
    return out if rank0 else None


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
            file = f"model-{i:05d}-of-{len(specs):05d}.safetensors"
            save_file(bucket, out / file, metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(bucket, file))
            total += sum(t.numel() * t.element_size() for t in bucket.values())
    if rank0:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    if dist.is_initialized():
        dist.barrier()  # the folder is complete when save_hf returns on any rank
