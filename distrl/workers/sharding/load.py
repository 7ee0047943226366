"""`load_sharded_causal_lm`: build an HF causal LM on the meta device, shard it, and read only this rank's slices.

No process ever materialises the whole model: the skeleton is built on `meta` (no storage), `shard` turns each
parameter into a `DTensor` whose local shard is all that `to_empty` allocates, and torch.distributed.checkpoint's
`HuggingFaceStorageReader` reads from the HF `*.safetensors` files just the rows of each tensor that the rank owns
(`safe_open(...).get_slice`), casting them to the parameters' float32.

What the files do not hold is rebuilt here: non-persistent buffers (rotary `inv_freq`) by the model's own
`_init_weights` for the modules that own them, and a tied LM head by being the same parameter as the embeddings.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh

from distrl.workers.sharding.wrap import shard


def aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameter names that are another name of an earlier parameter (a tied LM head -> the embedding)."""
    first: dict[int, str] = {}
    out = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            out[name] = first[id(param)]
        else:
            first[id(param)] = name
    return out


def load_sharded_causal_lm(path: str | Path, mesh: DeviceMesh, *, compute_dtype: torch.dtype = torch.float32,
                           cpu_offload: bool = False, trust_remote_code: bool = False) -> torch.nn.Module:
    """The HF model in `path`, float32 master weights, sharded over `mesh` by `shard`, in eval mode."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model: torch.nn.Module = AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                  trust_remote_code=trust_remote_code)
    shard(model, mesh, compute_dtype=compute_dtype, cpu_offload=cpu_offload)
    model.to_empty(device="cpu" if cpu_offload else mesh.device_type)
    _init_non_persistent_buffers(model)

    reader = HuggingFaceStorageReader(str(path))
    in_files = set(reader.read_metadata().state_dict_metadata)
    tied = aliases(model)
    state = {name: tensor for name, tensor in model.state_dict().items() if name not in tied}
    missing = sorted(set(state) - in_files)
    if missing:
        raise ValueError(f"model.path {path}: the safetensors files lack {missing[:5]} "
                         f"({len(missing)} tensors of {type(model).__name__})")
    dcp.load(state, storage_reader=reader)  # fills every local shard in place
    return model.eval()


def _init_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Recompute the buffers that checkpoints leave out, as `from_pretrained` does after its own meta build."""
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)  # type: ignore[operator]  # PreTrainedModel's, typed loosely as a Module
