"""The HF copy of a trained model in a checkpoint (policy/model/, critic/model/): a folder that transformers and vLLM
load as it is, in the rollout dtype with the tokenizer beside it.

Why the rollout dtype (`rollout.dtype`, bfloat16 by default) and not the float32 master weights or the source
model's own dtype: it is what the engines served and the fingerprint check verified, so serving or evaluating the
folder serves the policy that generated the run's data; it halves the folder against float32 (the float32 master
weights, which exact resume needs, are kept in the trainer's state: a replica's in trainer_state.safetensors, a
sharded model's in its shards); and for the models users train (Qwen2.5, Llama) it is their own dtype too. A run
whose engines sample in float32 (the CPU quickstart) exports float32.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from distrl.workers.model_files import DTYPES


@dataclass(frozen=True)
class HFExport:
    """How a checkpoint's HF copy is written: in `dtype`, with the tokenizer of the directory `tokenizer` (None:
    none), loaded with `trust_remote_code` as the model's (`model.trust_remote_code`)."""

    dtype: str
    tokenizer: str | None
    trust_remote_code: bool = False


def save_tokenizer(export: HFExport, directory: Path) -> None:
    """The tokenizer `export` names, saved into `directory` as transformers writes it."""
    from transformers import AutoTokenizer

    if export.tokenizer is not None:
        tokenizer = AutoTokenizer.from_pretrained(export.tokenizer, trust_remote_code=export.trust_remote_code)
        tokenizer.save_pretrained(directory)


def set_config_dtype(directory: Path, dtype: str) -> None:
    """Make config.json in `directory` say the files hold `dtype` (transformers writes the dtype of the live
    parameters, float32 masters here): `from_pretrained(dtype="auto")` and vLLM's `dtype: auto` read it."""
    config = directory / "config.json"
    tree = json.loads(config.read_text())
    tree["dtype"] = dtype
    tree.pop("torch_dtype", None)  # the older spelling of the same field
    config.write_text(json.dumps(tree, indent=2, sort_keys=True) + "\n")


class HFCopy:
    """A replica's model as `checkpoint.write_trainer` saves it: `save_pretrained` of its weights cast to
    `export.dtype` on the CPU (one cast copy in host memory; the live float32 weights are untouched), config
    saying that dtype, and the tokenizer."""

    def __init__(self, model: torch.nn.Module, export: HFExport):
        self.model, self.export = model, export

    def save_pretrained(self, directory: Path, safe_serialization: bool = True) -> None:
        dtype = DTYPES[self.export.dtype]
        state = {name: tensor.detach().to("cpu", dtype) for name, tensor in self.model.state_dict().items()}
        self.model.save_pretrained(directory, state_dict=state,  # type: ignore[operator]
                                   safe_serialization=safe_serialization)
        set_config_dtype(directory, self.export.dtype)
        save_tokenizer(self.export, directory)
