"""Critic: the value model of GAE, trained with the clipped value loss by the shared training core (`Trainer`), its
values before an update and its part of the checkpoints. Plain class, no Ray.

The value model is a transformers token-classification model with one label (as verl's critic): the policy's
backbone with a scalar head `score` on every position. Loaded from the policy's directory the head is missing there
and is initialised by transformers from the torch seed, which is set from `run.seed` first, so every critic of a run
starts from the same head.
"""

from __future__ import annotations

import torch

from distrl import checkpoint
from distrl.algo import masked_mean, value_loss
from distrl.config import CriticConfig, ModelConfig
from distrl.merging import Figure, Figures, Merge
from distrl.types import Sequences, TrainBatch
from distrl.workers import dist
from distrl.workers.device import granted_device
from distrl.workers.model import resolve_model_path
from distrl.workers.strategy import Replicated
from distrl.workers.trainer import Counts, Trainer


def load_value_model(model: ModelConfig, path: str | None, device: str) -> torch.nn.Module:
    """A token-classification model with one output (`num_labels=1`) from `path` (null: the policy's `model.path`),
    float32 on `device`, eval mode (the trainer switches it to train). Its classifier dropout is off (as verl's
    critic): the values the update fits must be the ones GAE used, not a noisy draw of them."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    where = resolve_model_path(model, path)
    config = AutoConfig.from_pretrained(where, num_labels=1, trust_remote_code=model.trust_remote_code)
    config.classifier_dropout = 0.0
    loaded: torch.nn.Module = AutoModelForTokenClassification.from_pretrained(
        where, config=config, dtype=torch.float32, trust_remote_code=model.trust_remote_code)
    return loaded.to(device).eval()


def response_values(model: torch.nn.Module, batch: Sequences) -> torch.Tensor:
    """Values of the response positions `[B, T]` float32: V_t is read at sequence position P - 1 + t, the state
    before response token t is emitted (where the policy's logits for token t are). Positions count from the first
    real token, as in `distrl.workers.model.response_logprobs`, so left padding does not shift them."""
    p, t = batch.prompt_len, batch.response_len
    position_ids = (batch.attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=position_ids)
    return out.logits[:, p - 1 : p - 1 + t, 0].float()


class Critic:
    """Trains the value model. With M critics, each holds a full replica and receives 1/M of every mini-batch."""

    def __init__(self, model: ModelConfig, cfg: CriticConfig, *, mini_batch_size: int, total_optimizer_steps: int,
                 seed: int, num_gpus: float = 0.0):
        torch.manual_seed(seed)  # the fresh value head's initialisation
        self.cfg = cfg
        self.device = granted_device(num_gpus, "critic")
        self.model = load_value_model(model, cfg.path, self.device)
        # Replicated only: config refuses critic.strategy fsdp (the sharded build reads causal LMs).
        self.trainer = Trainer(self.model, cfg, total_optimizer_steps, self.device, mini_batch_size,
                               Replicated(cfg, self.device), role="critic")

    # ------------------------------------------------------------------------------------------ data parallelism
    def connect(self, master_addr: str, master_port: int, rank: int, world_size: int) -> str:
        """Join the critics' own process group; returns the backend (gloo on CPU, NCCL on GPU)."""
        return dist.init_process_group(master_addr, master_port, rank, world_size, self.device)

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` (this actor's node): the rendezvous of the critics' group."""
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    # ------------------------------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def values(self, sequences: Sequences) -> torch.Tensor:
        """Values of the response positions before the update (GAE's V, the value loss's old values), no
        gradient: `[B, T]` float32 on CPU, 0 on padding."""
        self.model.eval()
        try:
            with self.trainer.autocast:
                seqs = sequences.to(self.device)
                out = torch.cat([response_values(self.model, mb) for mb in seqs.chunks(self.cfg.micro_batch_size)])
            return out.masked_fill(seqs.response_mask == 0, 0.0).cpu()
        finally:
            self.model.train()

    # ------------------------------------------------------------------------------------------------ training
    def update(self, batch: TrainBatch) -> Figures:
        """Epochs of the clipped value loss over this critic's shard (`Trainer.update`), towards `batch.returns`
        around `batch.old_values`. Returns figures to merge over critics with `distrl.merging.merge`, weighted by
        `critic/tokens`."""
        if batch.old_values is None or batch.returns is None:
            raise ValueError("Critic.update needs a batch with old_values and returns (GAE's)")
        return self.trainer.update(batch.to(self.device), self._value_loss)

    def _value_loss(self, model: torch.nn.Module, micro: TrainBatch, counts: Counts) -> tuple[torch.Tensor, Figures]:
        """The `Objective` of the critic: `value_loss` on the micro-batch's values under `model`, divided by the
        mini-batch's global token count."""
        assert micro.old_values is not None and micro.returns is not None  # checked in update
        values = response_values(model, micro.sequences)
        loss, metrics = value_loss(values, micro.old_values, micro.returns, micro.response_mask, self.cfg.value_clip,
                                   num_tokens=counts.num_tokens)
        return loss, {
            "critic/value_loss": Figure(float(loss.detach()), Merge.SUM),
            "critic/vf_clipfrac": Figure(float(metrics["vf_clipfrac"]), Merge.TOKEN_MEAN),
            "critic/values_mean": Figure(float(masked_mean(values.detach(), micro.response_mask)), Merge.TOKEN_MEAN),
        }

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str) -> None:
        """Write the critic's part of a checkpoint (`checkpoint.write_trainer`: the value model in HF format, the
        optimizer and schedule state) to `directory`; every critic is called, critic 0 writes the replica's."""
        self.trainer.save(directory, hf_model=True)

    def seen_digest(self, path: str) -> str | None:
        """`checkpoint.seen_digest` on this critic's node, where its checkpoint parts are written."""
        return checkpoint.seen_digest(path)

    def load_checkpoint(self, directory: str) -> None:
        """Continue from the critic part `directory` of a checkpoint: weights, optimizer, schedule and counters."""
        self.trainer.load(directory)
