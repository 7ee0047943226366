"""How the learners hold a trained model: `Replicated` (a full copy each) or `Sharded` (FSDP2); with `learner.lora`,
`Replicated` wraps its model in adapters and `ShardedBase` shards the frozen base under replicated adapters. Plain
classes, no Ray.

The training core, the weight export and the checkpoints ask the strategy for what differs:

    build        the float32 master model on this learner (sharded: on the meta device, then only its slices)
    lockstep     how many forward passes a learner makes (sharded: the most any learner needs)
    cast_weights weights cast to the compute dtype once per forward (sharded: FSDP's mixed-precision policy did)
    reduce_grads sum the gradients over the learners (sharded: FSDP's reduce-scatter already did, summing)
    clip         the global gradient norm, clipped
    bucket       one export bucket's full tensors on learner 0 (sharded: gathered, every learner taking part)
    pieces       this learner's own rows of an export bucket, which it sends itself (sharded: its block, no gather)
    own_blocks   the rows of every exported tensor this learner sends, for its part of the weights' fingerprint
    save / load  a trainer's part of a checkpoint (sharded: every learner writes its shards)

Every method of `Sharded` that touches parameters is a collective: every learner calls it, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from distrl import checkpoint
from distrl.config import FSDPStrategy, LearnerConfig, ModelConfig
from distrl.workers.model_files import DTYPES, resolve_model_path
from distrl.workers.training import dist, lora, sharding
from distrl.workers.training.mixed_precision import CastOncePerForward
from distrl.workers.training.model import load_causal_lm
from distrl.workers.training.sharding.load import aliases
from distrl.workers.weights import export
from distrl.workers.weights.hf_export import HFCopy, HFExport, save_tokenizer
from distrl.workers.weights.pieces import Pieces

SHARDS = "shards"
"""The subdirectory of a sharded trainer's part that holds the model and optimizer shards (`sharding.save`)."""


class Replicated:
    """Every learner holds the whole model and optimizer; gradients are all-reduced (summed)."""

    name = "replicate"
    sharded = False

    def __init__(self, cfg: LearnerConfig, device: str):
        self.cfg, self.device = cfg, device

    def build(self, model_cfg: ModelConfig, path: str | None = None) -> torch.nn.Module:
        """The model this learner trains: float32 master weights; with `learner.lora`, the base frozen in the compute
        dtype (`learner.dtype`: it is never updated, so it needs no float32 copy) under float32 adapters."""
        adapters = self.cfg.lora
        if adapters is None:
            return load_causal_lm(model_cfg, "float32", path=path, device=self.device)
        return lora.wrap(load_causal_lm(model_cfg, self.cfg.dtype, path=path, device=self.device), adapters)

    def cast_weights(self, model: torch.nn.Module) -> None:
        """Make `model` compute in `learner.dtype` over its float32 master weights: with a lower dtype, the weights
        are cast once per forward pass, layer by layer, by hooks on the model (`mixed_precision.CastOncePerForward`);
        its forward passes need no context."""
        dtype = DTYPES[self.cfg.dtype]
        if dtype != torch.float32:
            CastOncePerForward(model, dtype)

    def lockstep(self, passes: torch.Tensor) -> torch.Tensor:
        """How many forward passes this learner must make when it needs `passes` (one count per mini-batch or
        scoring call, on the device): as many as it needs."""
        return passes

    def reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        dist.all_reduce_grads_(params)

    def clip(self, params: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
        """Clip the gradients' global norm to `max_norm` (null: only measure); the norm before clipping, 0-dim on the
        device (left there: the trainer reads it with the step's other figures)."""
        return torch.nn.utils.clip_grad_norm_(params, max_norm or math.inf)

    def bucket(self, model: torch.nn.Module, spec: export.Spec, dtype: str, device: str = "cpu",
               every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The bucket's full tensors in `dtype` on `device` on learner 0 (empty on the others, unless
        `every_rank`)."""
        return export.bucket(model, spec, dtype, device) if every_rank or dist.rank() == 0 else {}

    def pieces(self, model: torch.nn.Module, spec: export.Spec, dtype: str) -> Pieces:
        """This learner's pieces of bucket `spec` in `dtype` on the CPU: learner 0 sends every tensor whole, the others
        nothing."""
        return Pieces.whole(export.bucket(model, spec, dtype)) if dist.rank() == 0 else Pieces()

    def own_blocks(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, int, int]]:
        """(HF name, the rows this learner sends, the first one's index, the tensor's row count) of every exported
        tensor: learner 0 sends them whole."""
        if dist.rank() == 0:
            for name, tensor in export.exported(model):
                yield name, tensor, 0, tensor.shape[0] if tensor.dim() else 1

    def save(self, directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
             hf: HFExport | None) -> checkpoint.FileList:
        """Write a trainer's part of a checkpoint to `directory`: the float32 weights (a tied name once), the
        optimizer's state and `state` (schedule, counters) among the tensors, and with `hf` an HF copy under model/
        (`HFCopy`); with LoRA adapters (`learner.lora`), the adapters in PEFT's format under adapter/ and no weights
        (the frozen base is the model's own files). Learner 0 writes a replica's; returns the files this learner
        wrote (none on the others)."""
        if dist.rank() != 0:
            return {}
        full = {**state, "optimizer": optimizer.state_dict()}
        if lora.is_adapted(model):
            return checkpoint.write_trainer(directory, model, full, lora.ADAPTER_DIR)
        tied = aliases(model)
        full["model"] = {name: tensor for name, tensor in model.state_dict().items() if name not in tied}
        return checkpoint.write_trainer(directory, HFCopy(model, hf) if hf else None, full)

    def load(self, directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             state: dict[str, Any]) -> dict[str, Any]:
        """Load what `save` wrote in `directory` (its trainer state read: `state`) into `model` and `optimizer`;
        returns the rest of the state. A checkpoint whose weights are only in its HF copy (written before the
        copy was cast to the rollout dtype) loads them from there."""
        adapters = Path(directory) / lora.ADAPTER_DIR
        if lora.is_adapted(model) != adapters.is_dir():
            raise RuntimeError(f"checkpoint {directory} holds " + ("adapters (learner.lora), and this run trains the "
                               "whole model" if adapters.is_dir() else "a whole model, and this run trains adapters "
                               "(learner.lora)") + ": resume with the learner.lora it was written with")
        if "model" in state:
            weights = state.pop("model")
            weights.update({alias: weights[name] for alias, name in aliases(model).items() if name in weights})
            model.load_state_dict(weights)
        elif adapters.is_dir():
            lora.load_adapter(adapters, model)
        else:
            checkpoint.load_model(directory, model)
        optimizer.load_state_dict(state.pop("optimizer"))
        return state


class Sharded(Replicated):
    """FSDP2 over the learners' process group: parameters, gradients and AdamW state sharded (see
    `distrl.workers.training.sharding`)."""

    name = "fsdp"
    sharded = True

    def __init__(self, cfg: LearnerConfig, device: str):
        super().__init__(cfg, device)
        assert isinstance(cfg.strategy, FSDPStrategy)
        self.cpu_offload = cfg.strategy.cpu_offload

    def build(self, model_cfg: ModelConfig, path: str | None = None) -> torch.nn.Module:
        if not torch.distributed.is_initialized():
            raise RuntimeError("learner.strategy 'fsdp': the learners' process group must be joined (connect) "
                               "before the model is built")
        return sharding.load_sharded_causal_lm(resolve_model_path(model_cfg, path), sharding.learner_mesh(self.device),
                                               compute_dtype=DTYPES[self.cfg.dtype], cpu_offload=self.cpu_offload,
                                               trust_remote_code=model_cfg.trust_remote_code)

    def cast_weights(self, model: torch.nn.Module) -> None:
        pass  # the build gave FSDP a MixedPrecisionPolicy: it gathers the parameters in the compute dtype

    def lockstep(self, passes: torch.Tensor) -> torch.Tensor:
        """The most forward passes any learner needs, all-reduced in place and left on the device for the caller to
        read with its other figures: FSDP's forwards are collectives, so every learner makes as many (a token budget
        may give learners different counts; the others split or add empty ones)."""
        return dist.all_reduce_(passes, torch.distributed.ReduceOp.MAX)

    def reduce_grads(self, params: list[torch.nn.Parameter]) -> None:
        pass  # each backward reduce-scattered (summed) its gradients into the shards

    def clip(self, params: list[torch.nn.Parameter], max_norm: float | None) -> torch.Tensor:
        return sharding.clip_grad_norm_(params, max_norm or math.inf)

    def bucket(self, model: torch.nn.Module, spec: export.Spec, dtype: str, device: str = "cpu",
               every_rank: bool = False) -> dict[str, torch.Tensor]:
        """The bucket's full tensors in `dtype` on `device` on learner 0 (on every learner with `every_rank`; empty
        on the others), gathered from the shards cast to `dtype`; gathered on the GPU, a bucket for the GPU (an NCCL
        push, a hybrid actor's engine) stays there."""
        return sharding.gather_bucket(model, spec, DTYPES[dtype], device, every_rank) or {}

    def pieces(self, model: torch.nn.Module, spec: export.Spec, dtype: str) -> Pieces:
        """This learner's own block of each tensor of bucket `spec`, in `dtype` on the CPU: no gather."""
        return sharding.local_pieces(model, spec, DTYPES[dtype])

    def own_blocks(self, model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor, int, int]]:
        """Every exported tensor's block that this learner sends (`sharding.local_pieces`' blocks)."""
        for name, tensor in export.exported(model):
            block, start, sends = sharding.own_rows(tensor)
            if sends and block.numel():
                yield name, block, start, tensor.shape[0] if tensor.dim() else 1

    def save(self, directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any],
             hf: HFExport | None) -> checkpoint.FileList:
        """Every learner writes its shards of the model and optimizer to `directory`/shards; learner 0 writes
        `state` and, with `hf`, the model gathered in HF format (model/, bucket by bucket, in `hf.dtype`) with the
        tokenizer. Returns the files this learner wrote."""
        written = sharding.save(Path(directory) / SHARDS, model, optimizer)
        if hf:
            sharding.save_hf(model, Path(directory) / "model", dtype=DTYPES[hf.dtype])
        files = checkpoint.describe(directory, written)
        if dist.rank() == 0:
            if hf:
                save_tokenizer(hf, Path(directory) / "model")
                files.update(checkpoint.describe(directory, sorted(p for p in (Path(directory) / "model").rglob("*")
                                                                   if p.is_file())))
            files.update(checkpoint.write_trainer(directory, None, state))
        torch.distributed.barrier()
        return files

    def load(self, directory: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             state: dict[str, Any]) -> dict[str, Any]:
        sharding.load(Path(directory) / SHARDS, model, optimizer)
        return state


class ShardedBase(Sharded):
    """`fsdp` with `learner.lora`: the frozen base sharded over the learners (FSDP2, each holding 1/M of it, with no
    gradients or optimizer state for it), the adapters, ~1% of the model, replicated on every learner as under
    `replicate`: their gradients all-reduced (summed) and clipped as plain tensors, pushed and checkpointed (in PEFT's
    format, with their optimizer state) by learner 0; served merged (`learner.lora.serve`), each learner sends the
    merged rows of its own base blocks. Forward passes stay collectives (`Sharded.lockstep`); the base
    comes from the model's files, so checkpoints need none of it."""

    name = "replicate"  # what a checkpoint holds (the adapters and their optimizer state) is a replica's: either
    # strategy resumes it

    def build(self, model_cfg: ModelConfig, path: str | None = None) -> torch.nn.Module:
        assert self.cfg.lora is not None
        return lora.wrap(super().build(model_cfg, path), self.cfg.lora)  # adapters on the sharded base's layers

    reduce_grads = Replicated.reduce_grads
    clip = Replicated.clip
    save = Replicated.save
    load = Replicated.load


def make_strategy(cfg: LearnerConfig, device: str) -> Replicated:
    """The strategy `learner.strategy` names."""
    if isinstance(cfg.strategy, FSDPStrategy):
        return ShardedBase(cfg, device) if cfg.lora is not None else Sharded(cfg, device)
    return Replicated(cfg, device)
