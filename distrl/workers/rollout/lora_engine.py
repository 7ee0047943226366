"""The policy's adapters (`learner.lora`) inside a vLLM engine: registering pushed tensors in memory, and reading back
what the engine's active LoRA slot holds for the fingerprint check. Each function runs in the engine's worker
(`LLM.collective_rpc`; in-process with `VLLM_ENABLE_V1_MULTIPROCESSING=0`). Plain code, no Ray.

vLLM has no public way to serve adapter tensors without a file (a `LoRARequest` needs a path, and a path is read
once per int id: the same id with a new file is served stale), so `register` goes through the worker's LoRA manager,
as measured in `shared/probes/vllm-cpu-lora-2026-11-24.md`:

- Each version gets its own int id and name (`request_for`): vLLM's prefix cache keys blocks by the adapter's
  name and path, and its LRU by the int id, so neither can hand a new version an old one's state.
- `LoRAModel.from_lora_tensors` keeps the tensors it is given and `optimize` then multiplies B by alpha / r in
  place: the tensors are cloned first, or a second engine in the process (tests) would scale them again.
- The previous version is removed before the new one is activated, once the engine is drained
  (`RolloutWorker.load_weights`): an engine serves one adapter (`max_loras=1`) and every request carries it (never
  a request without an adapter: vLLM's CPU LoRA kernels serve a request without one the adapter in the last slot),
  so no request can fall back to reloading a vanished version from its placeholder path, which would fail it and
  stall the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from distrl.workers.rollout.served_weights import linear_regions
from distrl.workers.weights.fingerprint import Fingerprint, Held, Region, key, of_sample, sample

PEFT_PREFIX = "base_model.model."
"""What PEFT's adapter names put before the HF module name."""


def lora_id(version: int) -> int:
    """The int id of policy version `version`'s adapters (vLLM's ids start at 1)."""
    return version + 1


def request_for(version: int) -> Any:
    """The `LoRARequest` every request of policy version `version` carries: its own id and name, and a path that
    does not exist (the adapters are registered from memory; a path is required, and one per version keeps the
    prefix cache's keys apart)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"distrl-v{version}", lora_id(version), f"/distrl-in-memory/v{version}")


def register(worker: Any, version: int, tensors: dict[str, torch.Tensor], peft_cfg: dict[str, Any],
             previous: int | None) -> int:
    """In the engine's worker: make `tensors` (PEFT-named adapter tensors, `peft_cfg` their PEFT config) the adapter
    of `version`, in the one active slot, in place of `previous`'s; returns the number of adapter modules loaded."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    workers = worker.model_runner.lora_manager
    manager = workers._adapter_manager
    helper = PEFTHelper.from_dict({**peft_cfg, "vllm_max_position_embeddings": workers.max_position_embeddings})
    helper.validate_legal(workers.lora_config)
    mapper = getattr(manager.model, "hf_to_vllm_mapper", None)
    model = LoRAModel.from_lora_tensors(
        lora_id(version), {name: t.clone() for name, t in tensors.items()}, helper, device="cpu",  # as vLLM loads
        dtype=workers.lora_config.lora_dtype, model_vocab_size=workers.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper else None)
    if previous is not None:
        manager.remove_adapter(lora_id(previous))
    manager.remove_adapter(lora_id(version))  # a version pushed again (a replacement engine) is loaded anew
    manager.add_adapter(model)
    manager.activate_adapter(lora_id(version))
    return len(model.loras)


def slot_fingerprint(worker: Any, version: int, rank: int) -> Fingerprint:
    """In the engine's worker: the fingerprint (`distrl.workers.weights.fingerprint`) of the adapter tensors in the LoRA
    slot that serves `version`, under PEFT's names and the region of each this worker holds (`slot_regions`): A
    `[r, in]` and B `[out, r]` of each projection, packed layers (`qkv_proj`, `gate_up_proj`) split back into their
    HF projections. B is as the kernels use it, scaled by alpha / r. Empty when `version`'s adapters are in no slot
    (the engine would not serve them)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    if lora_id(version) not in manager.lora_index_to_id:
        return {}
    index = manager.lora_index_to_id.index(lora_id(version))
    with torch.no_grad():
        return {key(name, region): of_sample(sample(tensor)) for name, region, tensor in _slot(manager, index, rank)}


def slot_regions(worker: Any) -> Held:
    """In the engine's worker: the region of each adapter tensor (PEFT name) this worker holds, as its LoRA layers
    keep them (vLLM slices them as it slices their base layers: a column-parallel projection's B by output rows, a
    row-parallel one's A by input columns; the other factor whole)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    return [(name, region) for name, region, _ in _slot(manager, 0, 0)]


def _slot(manager: Any, index: int, rank: int) -> Iterator[tuple[str, Region, torch.Tensor]]:
    """(PEFT name, region, tensor) of the adapters in slot `index`, rank `rank`'s first columns of A and B."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    packed: dict[str, list[str]] = manager.packed_modules_mapping
    for name, module in manager.modules.items():
        if not hasattr(module, "n_slices"):  # the embedding or LM head, which learner.lora never targets
            continue
        parent, _, leaf = name.rpartition(".")
        parts = packed.get(leaf, [leaf])
        if len(parts) != module.n_slices:
            parts = [leaf]
        base = module.base_layer
        sizes = list(getattr(base, "output_partition_sizes", [0]))
        regions = linear_regions(base, sizes if len(sizes) == len(parts) else [sum(sizes)])[0]
        row_parallel = isinstance(base, RowParallelLinear)
        for i, part in enumerate(parts):
            full = f"{PEFT_PREFIX}{parent}.{part}" if parent else f"{PEFT_PREFIX}{part}"
            yield (f"{full}.lora_A.weight", regions[i] if row_parallel else None,
                   module.lora_a_stacked[i][index, 0, :rank])
            yield (f"{full}.lora_B.weight", None if row_parallel else regions[i],
                   module.lora_b_stacked[i][index, 0, :, :rank])
