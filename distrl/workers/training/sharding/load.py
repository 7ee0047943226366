"""`load_sharded_causal_lm`: build an HF causal LM on the meta device, shard it, and read only this rank's slices.

No process ever materialises the whole model: the skeleton is built on `meta` (no storage), `shard` turns each
parameter into a `DTensor` whose local shard is all that `to_empty` allocates, and torch.distributed.checkpoint's
`HuggingFaceStorageReader` reads from the HF `*.safetensors` files just the rows of each tensor that the rank owns
(`safe_open(...).get_slice`), casting them to the parameters' float32.

What the files do not hold is rebuilt here: non-persistent buffers (rotary `inv_freq`) by the model's own
`_init_weights` for the modules that own them, and a tied LM head by being the same parameter as the embeddings.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from distrl.workers.training.sharding.wrap import own_rows, shard


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
    """The HF model in `path`, float32 master weights, sharded over `mesh` by `shard`, in eval mode, whose
    attention keeps packed sequences apart (`PACKED_ATTENTION`, as `distrl.workers.training.model.load_causal_lm`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from distrl.workers.training.packed_attention import PACKED_ATTENTION

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return load_sharded(AutoModelForCausalLM, config, path, mesh, compute_dtype=compute_dtype,
                        cpu_offload=cpu_offload, trust_remote_code=trust_remote_code,
                        attn_implementation=PACKED_ATTENTION)


def load_sharded(auto_class, config, path: str | Path, mesh: DeviceMesh, *, compute_dtype: torch.dtype = torch.float32,
                 cpu_offload: bool = False, trust_remote_code: bool = False, seed: int | None = None,
                 fresh_if_missing: tuple[str, ...] = (), field: str = "model.path",
                 attn_implementation: str | None = None) -> torch.nn.Module:
    """`auto_class` (an HF auto class) built from `config` on the meta device, sharded over `mesh` by `shard`, its
    weights read from the files in `path`, float32, eval mode.

    A top-level module named in `fresh_if_missing` whose tensors the files lack (a value head on a policy's files)
    is initialised instead, as `init_fresh` does on an unsharded model: the same values on every rank and in a
    replica made with the same `seed`. `field` names the config field of `path` in errors; `attn_implementation`
    is transformers' (its default when None)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(str(path))
    in_files = set(reader.read_metadata().state_dict_metadata)
    with torch.device("meta"):
        model: torch.nn.Module = auto_class.from_config(config, dtype=torch.float32,
                                                        trust_remote_code=trust_remote_code,
                                                        attn_implementation=attn_implementation)
    fresh = {name: copy.deepcopy(model.get_submodule(name)) for name in fresh_if_missing
             if hasattr(model, name) and not any(k.startswith(name + ".") for k in in_files)}
    shard(model, mesh, compute_dtype=compute_dtype, cpu_offload=cpu_offload)
    model.to_empty(device="cpu" if cpu_offload else mesh.device_type)
    _init_non_persistent_buffers(model)
    for name, meta_module in fresh.items():
        full = init_fresh(model, meta_module.to_empty(device="cpu"), seed)
        for param_name, param in full.named_parameters():
            target = model.get_parameter(f"{name}.{param_name}")
            value: torch.Tensor = param.detach()
            if isinstance(target, DTensor):  # each rank keeps its shard of the same full tensor
                value = distribute_tensor(value, target.device_mesh, target.placements)
            with torch.no_grad():
                target.copy_(value.to(target.device))
    tied = aliases(model)
    state = {name: tensor for name, tensor in model.state_dict().items()
             if name not in tied and name.split(".")[0] not in fresh}
    stacks = {name: parts for name in set(state) - in_files if (parts := expert_files(name, in_files))}
    missing = sorted(set(state) - in_files - set(stacks))
    if missing:
        raise ValueError(f"{field} {path}: the safetensors files lack {missing[:5]} "
                         f"({len(missing)} tensors of {type(model).__name__})")
    dcp.load({k: v for k, v in state.items() if k not in stacks}, storage_reader=reader)  # every local shard in place
    _load_expert_stacks(Path(path), {name: (state[name], parts) for name, parts in stacks.items()})
    return model.eval()


EXPERT_FILES = {
    ".experts.gate_up_proj": ((".experts.{e}.gate_proj.weight", ".experts.{e}.up_proj.weight"),
                              (".experts.{e}.w1.weight", ".experts.{e}.w3.weight")),
    ".experts.down_proj": ((".experts.{e}.down_proj.weight",), (".experts.{e}.w2.weight",)),
}
"""A mixture of experts' stack (transformers 5's name) -> the per-expert tensors a checkpoint holds it as, in
Qwen3-MoE's and in Mixtral's names (the parts of a fused stack concatenated along its rows)."""

MODULE_NAMES = (".mlp.", ".block_sparse_moe.")
"""Where the checkpoint's experts live: transformers' module name, and Mixtral's in its checkpoints."""


def expert_files(name: str, in_files: set[str]) -> list[str] | None:
    """The names the files hold tensor `name` under, when they hold it as a mixture of experts' checkpoint does: a
    stack's per-expert parts, in order (patterns with `{e}` for the expert), or Mixtral's module name for the
    tensor whole (its router); None otherwise."""
    layouts = next((layouts for suffix, layouts in EXPERT_FILES.items() if name.endswith(suffix)), None)
    prefix = name.removesuffix(next((suffix for suffix in EXPERT_FILES if name.endswith(suffix)), ""))
    for module in MODULE_NAMES:
        for parts in layouts or ((name.removeprefix(prefix),),):
            names = [(prefix + part).replace(MODULE_NAMES[0], module) for part in parts]
            if all(n.format(e=0) in in_files for n in names):
                return names
    return None


@torch.no_grad()
def _load_expert_stacks(path: Path, stacks: dict[str, tuple[torch.Tensor, list[str]]]) -> None:
    """Fill each rank's experts of every stack (its block of dimension 0, the experts) from the per-expert tensors
    of the files: each expert's parts concatenated along their rows, read only for this rank's experts; a tensor
    under another module name, its rows."""
    import json

    from safetensors import safe_open


    if not stacks:
        return
    index = path / "model.safetensors.index.json"
    where = (json.loads(index.read_text())["weight_map"] if index.exists()
             else dict.fromkeys(safe_open(path / "model.safetensors", "pt").keys(), "model.safetensors"))
    def read(name: str) -> torch.Tensor:
        return safe_open(path / where[name], "pt").get_tensor(name)

    for tensor, parts in stacks.values():
        block, start, _ = own_rows(tensor)
        if "{e}" not in parts[0]:  # a tensor under another module name: this rank's rows of it
            block.copy_(read(parts[0])[start:start + block.shape[0]].to(block.dtype))
            continue
        for i in range(block.shape[0]):
            block[i].copy_(torch.cat([read(part.format(e=start + i)) for part in parts]).to(block.dtype))


def init_fresh(model: torch.nn.Module, module: torch.nn.Module, seed: int | None) -> torch.nn.Module:
    """`module` (unsharded, on the CPU) initialised by `model`'s own `_init_weights`, from `seed` when given."""
    if seed is not None:
        torch.manual_seed(seed)
    model._init_weights(module)  # type: ignore[operator]  # PreTrainedModel's, typed loosely as a Module
    return module


def _init_non_persistent_buffers(model: torch.nn.Module) -> None:
    """Recompute the buffers that checkpoints leave out, as `from_pretrained` does after its own meta build."""
    for module in model.modules():
        if module._non_persistent_buffers_set:
            model._init_weights(module)  # type: ignore[operator]  # PreTrainedModel's, typed loosely as a Module
