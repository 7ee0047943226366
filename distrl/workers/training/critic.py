"""Critic: the value model of GAE, trained with the clipped value loss by the shared training core (`Trainer`), its
values before an update and its part of the checkpoints. Plain class, no Ray.

The value model is a transformers token-classification model with one label (as verl's critic): the policy's
backbone with a scalar head `score` on every position. Loaded from the policy's directory the head is missing there
and is initialised by transformers from the torch seed, which is set from `run.seed` first, so every critic of a run
starts from the same head.
"""

from __future__ import annotations

import atexit

import torch

from distrl import checkpoint
from distrl.algo import masked_mean, value_loss
from distrl.config import CriticConfig, FSDPStrategy, ModelConfig
from distrl.merging import Figures, Merge
from distrl.types.batches import Sequences, TrainBatch, on_host
from distrl.workers.device import granted_device
from distrl.workers.model_files import DTYPES, resolve_model_path, tokenizer_path
from distrl.workers.training import dist, sharding
from distrl.workers.training.kernels import apply_kernels
from distrl.workers.training.model import packed_inputs, score_rows
from distrl.workers.training.packed_attention import PACKED_ATTENTION
from distrl.workers.training.packing import Layout, host_layout
from distrl.workers.training.sharding.load import init_fresh
from distrl.workers.training.strategy import make_strategy
from distrl.workers.training.trainer import Counts, Measured, Trainer
from distrl.workers.weights.hf_export import HFExport

HEADS = ("score", "classifier")
"""Where transformers' token-classification models keep their head (Llama, Qwen2: `score`)."""


def value_model_config(model: ModelConfig, path: str | None):
    """(directory, HF config) of the value model: a token-classification model with one output (`num_labels=1`)
    from `path` (null: the policy's `model.path`). Its classifier dropout is off (as verl's critic): the values the
    update fits must be the ones GAE used, not a noisy draw of them."""
    from transformers import AutoConfig

    where = resolve_model_path(model, path)
    config = AutoConfig.from_pretrained(where, num_labels=1, trust_remote_code=model.trust_remote_code)
    config.classifier_dropout = 0.0
    return where, config


def load_value_model(model: ModelConfig, path: str | None, device: str, seed: int) -> torch.nn.Module:
    """The value model (`value_model_config`), float32 on `device`, eval mode (the trainer switches it to train).
    A head the files lack is initialised from `seed` (`sharding.load.init_fresh`, as the sharded build does)."""
    from transformers import AutoModelForTokenClassification

    where, config = value_model_config(model, path)
    loaded, info = AutoModelForTokenClassification.from_pretrained(
        where, config=config, dtype=torch.float32, trust_remote_code=model.trust_remote_code,
        attn_implementation=PACKED_ATTENTION, output_loading_info=True)
    for head in HEADS:
        if any(key.startswith(head + ".") for key in info["missing_keys"]):
            init_fresh(loaded, loaded.get_submodule(head), seed)
    return loaded.to(device).eval()


def load_sharded_value_model(model: ModelConfig, path: str | None, device: str, seed: int,
                             cfg: CriticConfig) -> torch.nn.Module:
    """The value model sharded over the critics' group (`critic.strategy: fsdp`), built on the meta device."""
    from transformers import AutoModelForTokenClassification

    where, config = value_model_config(model, path)
    assert isinstance(cfg.strategy, FSDPStrategy)
    return sharding.load_sharded(AutoModelForTokenClassification, config, where, sharding.learner_mesh(device),
                                 compute_dtype=DTYPES[cfg.dtype], cpu_offload=cfg.strategy.cpu_offload,
                                 trust_remote_code=model.trust_remote_code, seed=seed, fresh_if_missing=HEADS,
                                 field="critic.path" if path else "model.path",
                                 attn_implementation=PACKED_ATTENTION)


def response_values(model: torch.nn.Module, batch: Sequences, layout: Layout | None = None) -> torch.Tensor:
    """Values of the response tokens `[B, T]` float32, 0 on padding: V_t is read at the position before response
    token t (where the policy's logits for token t are), the state before it is emitted. One packed forward pass,
    as `distrl.workers.training.model.response_logprobs` (no padding reaches the model; `layout` made on the host, else
    here from `batch`); zero rows give `[0, T]`, still connected to the graph. A split layout (sequence parallelism)
    runs this critic's slice and gathers the group's values (`Layout.gather`)."""
    if layout is None:
        layout = host_layout(batch).to(batch.input_ids.device)
    values = model(**packed_inputs(model, layout)).logits[0, :, 0]
    gathered = layout.gather(values[layout.predicts].float())
    assert gathered is not None
    return layout.unpack(gathered)


class Critic:
    """Trains the value model. With M critics, each receives 1/M of every mini-batch and holds a full replica
    (`critic.strategy: replicate`) or 1/M of the model (`fsdp`)."""

    def __init__(self, model: ModelConfig, cfg: CriticConfig, *, mini_batch_size: int, total_optimizer_steps: int,
                 seed: int, num_gpus: float = 0.0):
        self.cfg, self.model_cfg, self.seed = cfg, model, seed
        self.mini_batch_size, self.total_optimizer_steps = mini_batch_size, total_optimizer_steps
        self.device = granted_device(num_gpus, "critic")
        self.strategy = make_strategy(cfg, self.device)
        if not self.strategy.sharded:  # a sharded model is built once the critics' group is joined (connect)
            self._build(load_value_model(model, cfg.path, self.device, seed))

    def _build(self, value_model: torch.nn.Module) -> None:
        self.model = apply_kernels(value_model, self.cfg.kernels, self.device, "critic.kernels")
        self.trainer = Trainer(self.model, self.cfg, self.total_optimizer_steps, self.device, self.mini_batch_size,
                               self.strategy, role="critic")

    # ------------------------------------------------------------------------------------------ data parallelism
    def connect(self, master_addr: str, master_port: int, rank: int, world_size: int,
                timeout_s: float = dist.default_pg_timeout.total_seconds()) -> str:
        """Join the critics' own process group (and build a sharded value model over it); returns the backend (gloo
        on CPU, NCCL on GPU). `timeout_s` bounds each of its collectives (`dist.init_process_group`)."""
        backend = dist.init_process_group(master_addr, master_port, rank, world_size, self.device, timeout_s,
                                          self.cfg.sequence_parallel_size)
        atexit.register(self.close)  # a graceful exit leaves the group first (`Learner.connect`)
        if self.strategy.sharded:
            self._build(load_sharded_value_model(self.model_cfg, self.cfg.path, self.device, self.seed, self.cfg))
        return backend

    def close(self) -> None:
        """Drop the value model and optimizer and leave the critics' group, ending its threads (`Learner.close`)."""
        atexit.unregister(self.close)
        self.__dict__.pop("model", None)
        self.__dict__.pop("trainer", None)
        dist.leave_process_group()

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` (this actor's node): the rendezvous of the critics' group."""
        return dist.free_port(host)

    # ------------------------------------------------------------------------------------------------- scoring
    def values(self, sequences: Sequences) -> torch.Tensor:
        """Values of the response positions before the update (GAE's V, the value loss's old values), no
        gradient: `[B, T]` float32 on CPU, 0 on padding; in the micro-batches the update forms (token budget,
        lockstep)."""
        seqs = on_host(sequences)  # micro-batches and layouts are made there
        self.model.eval()
        try:
            return score_rows(lambda micro, layout: response_values(self.model, micro, layout), seqs,
                              self.trainer.micro_batches(seqs), self.device, dist.sequence_split())
        finally:
            self.model.train()

    # ------------------------------------------------------------------------------------------------ training
    def update(self, batch: TrainBatch) -> Figures:
        """Epochs of the clipped value loss over this critic's shard (`Trainer.update`), towards `batch.returns`
        around `batch.old_values`. Returns figures to merge over critics with `distrl.merging.merge`, weighted by
        `critic/tokens`."""
        if batch.old_values is None or batch.returns is None:
            raise ValueError("Critic.update needs a batch with old_values and returns (GAE's)")
        return self.trainer.update(batch, self._value_loss)

    def _value_loss(self, model: torch.nn.Module, micro: TrainBatch, counts: Counts,
                    layout: Layout | None = None) -> tuple[torch.Tensor, Measured]:
        """The `Objective` of the critic: `value_loss` on the micro-batch's values under `model`, divided by the
        mini-batch's global token count."""
        assert micro.old_values is not None and micro.returns is not None  # checked in update
        values = response_values(model, micro.sequences, layout)
        loss, metrics = value_loss(values, micro.old_values, micro.returns, micro.response_mask, self.cfg.value_clip,
                                   num_tokens=counts.num_tokens)
        return loss, {
            "critic/value_loss": (loss.detach(), Merge.SUM),
            "critic/vf_clipfrac": (metrics["vf_clipfrac"], Merge.TOKEN_MEAN),
            "critic/values_mean": (masked_mean(values.detach(), micro.response_mask), Merge.TOKEN_MEAN),
        }

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str, hf_dtype: str = "bfloat16") -> checkpoint.FileList:
        """Write the critic's part of a checkpoint (the value model in HF format in `hf_dtype` with the policy's
        tokenizer, which it shares; the float32 weights, optimizer and schedule state) to `directory`; every critic
        is called, critic 0 writes a replica's. Returns the files this critic wrote."""
        return self.trainer.save(directory, HFExport(hf_dtype, tokenizer_path(self.model_cfg),
                                                     self.model_cfg.trust_remote_code))

    def seen_digest(self, path: str) -> str | None:
        """`checkpoint.seen_digest` on this critic's node, where its checkpoint parts are written."""
        return checkpoint.seen_digest(path)

    def load_checkpoint(self, directory: str) -> None:
        """Continue from the critic part `directory` of a checkpoint: weights, optimizer, schedule and counters."""
        self.trainer.load(directory)
