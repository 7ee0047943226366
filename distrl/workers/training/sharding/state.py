"""Sharded checkpoints of model + optimizer with torch.distributed.checkpoint (DCP), free of pickle.

`save` has every rank write its own shards into one directory through DCP's `HuggingFaceStorageWriter` with
`save_distributed=True`: one `shard-0000R-model-00001-of-00001.safetensors` per rank R, each tensor stored under
its flat name (`model.<HF name>`, `optimizer.state.<HF name>.exp_avg`, ...) with its offset in the full tensor in
the file's JSON header. That writer writes no `.metadata` (DCP's default metadata file is a pickle): the reader
(`HuggingFaceStorageReader`) rebuilds the layout from the safetensors headers, so loading runs no code from the
files, and it can load into any number of ranks (DCP reshards). What is not a tensor (the optimizer's
hyper-parameters per parameter: lr, betas, eps, weight decay, ...) goes to `optimizer_groups.json`, from rank 0.

A parameter reached under two names (tied embeddings: Qwen2.5's `lm_head.weight` is `model.embed_tokens.weight`) is
stored once, under its first name: safetensors refuses two keys on one storage, and loading the first name loads
the parameter that both names hold.

Scheduler state and step counters are the caller's (`distrl.checkpoint.save_state`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import HuggingFaceStorageWriter

from distrl.workers.training.sharding.load import aliases

GROUPS = "optimizer_groups.json"
MODEL, OPTIMIZER = "model.", "optimizer."


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(tensors under their checkpoint keys, the optimizer's other values) of the live model and optimizer.

    The tensors share storage with the model's shards and the optimizer's state; a fresh optimizer's state is
    created here first (a zero-learning-rate step of zeros, by `get_state_dict`) so that there is something to
    load into."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=StateDictOptions(flatten_optimizer_state_dict=True))
    tied = aliases(model)
    tensors: dict[str, Any] = {MODEL + k: v for k, v in model_state.items() if k not in tied}
    tensors.update({OPTIMIZER + k: v for k, v in optim_state.items() if isinstance(v, torch.Tensor)})
    others = {k: v for k, v in optim_state.items() if not isinstance(v, torch.Tensor)}
    return tensors, others


def save(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[Path]:
    """Write the sharded model and optimizer state to `directory` (created); every rank must call it. Returns the
    files this rank wrote (its shard file; rank 0 also `GROUPS`)."""
    import torch.distributed.checkpoint as dcp

    tensors, others = _state(model, optimizer)
    writer = RecordingWriter(str(directory), save_distributed=True)
    dcp.save(tensors, storage_writer=writer)
    written = [Path(directory) / name for name in sorted(writer.written)]
    if not dist.is_initialized() or dist.get_rank() == 0:
        (Path(directory) / GROUPS).write_text(json.dumps(others, indent=1))
        written.append(Path(directory) / GROUPS)
    if dist.is_initialized():
        dist.barrier()
    return written


class RecordingWriter(HuggingFaceStorageWriter):
    """DCP's HF writer that remembers the files this rank wrote (`written`, names relative to its directory), from its
    own write results: the checkpoint's manifest lists them without listing a directory other nodes write into."""

    def __init__(self, path: str, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.written: set[str] = set()

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.written |= {result.storage_data.relative_path for result in future.wait()}
        return future


def load(directory: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Load what `save` wrote into `model` (sharded the same way or not, on any number of ranks) and `optimizer`;
    every rank must call it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    tensors, others = _state(model, optimizer)
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(directory)))
    saved = json.loads((Path(directory) / GROUPS).read_text())
    if set(saved) != set(others):
        raise ValueError(f"checkpoint {directory}: {GROUPS} has other optimizer entries than this optimizer "
                         f"(only in the file: {sorted(set(saved) - set(others))[:3]}, only here: "
                         f"{sorted(set(others) - set(saved))[:3]})")
    # JSON has no tuples: give back the live value's type (AdamW's betas).
    groups = {k: tuple(v) if isinstance(others[k], tuple) else v for k, v in saved.items()}
    model_state = {k[len(MODEL):]: v for k, v in tensors.items() if k.startswith(MODEL)}
    model_state.update({alias: model_state[name] for alias, name in aliases(model).items()})
    optim_state = {k[len(OPTIMIZER):]: v for k, v in tensors.items() if k.startswith(OPTIMIZER)} | groups
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                   options=StateDictOptions(flatten_optimizer_state_dict=True))
