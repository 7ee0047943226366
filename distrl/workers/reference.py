"""Reference worker: a frozen copy of the initial policy that scores batches for the KL term. Plain class, no Ray."""

from __future__ import annotations

import torch

from distrl.config import ModelConfig, ReferenceConfig
from distrl.types.batches import Sequences
from distrl.workers.device import granted_device
from distrl.workers.kernels import apply_kernels
from distrl.workers.model import load_causal_lm, score_in_micro_batches
from distrl.workers.token_budget import auto_token_budget


class ReferenceWorker:
    """`logprobs(batch) -> [B, T]`: reference log-probs of the response tokens, temperature-scaled as the learner's."""

    def __init__(self, cfg: ReferenceConfig, model: ModelConfig, temperature: float, num_gpus: float = 0.0):
        self.cfg = cfg
        self.temperature = temperature
        device = granted_device(num_gpus, "reference")
        loaded = load_causal_lm(model, cfg.dtype, path=cfg.path, device=device).requires_grad_(False)
        self.model = apply_kernels(loaded, cfg.kernels, device, "reference.kernels")
        self.device = device
        budget = cfg.max_tokens_per_micro_batch
        self.token_budget = budget if budget != "auto" else auto_token_budget(
            self.model, device, training=False, field="reference.max_tokens_per_micro_batch")
        """Tokens of one forward pass (`reference.max_tokens_per_micro_batch`, `auto` resolved), or None."""

    def logprobs(self, sequences: Sequences) -> torch.Tensor:
        """`[B, T]` float32 on the CPU, 0 on padding: the batch (kept on the host) scored in micro-batches."""
        return score_in_micro_batches(self.model, sequences, self.temperature, self.cfg.micro_batch_size,
                                      self.token_budget, device=self.device)
