"""Reference worker: a frozen copy of the initial policy that scores batches for the KL term. Plain class, no Ray."""

from __future__ import annotations

import torch

from distrl.config import ModelConfig, ReferenceConfig
from distrl.console import say
from distrl.types.batches import Sequences
from distrl.workers.device import granted_device
from distrl.workers.training.kernels import apply_kernels
from distrl.workers.training.model import load_causal_lm, score_in_micro_batches
from distrl.workers.training.token_budget import auto_token_budget


class ReferenceWorker:
    """`logprobs(batch) -> [B, T]`: reference log-probs of the response tokens, temperature-scaled as the learner's.
    `share_device`: other parts of the process (a hybrid actor's learner and engine) share the device, and an
    `auto` token budget waits for `resolve_token_budget`."""

    def __init__(self, cfg: ReferenceConfig, model: ModelConfig, temperature: float, num_gpus: float = 0.0,
                 share_device: bool = False):
        self.cfg = cfg
        self.temperature = temperature
        device = granted_device(num_gpus, "reference")
        loaded = load_causal_lm(model, cfg.dtype, path=cfg.path, device=device).requires_grad_(False)
        self.model = apply_kernels(loaded, cfg.kernels, device, "reference.kernels")
        self.device = device
        budget = cfg.max_tokens_per_micro_batch
        self.token_budget: int | None = None if budget == "auto" else budget
        """Tokens of one forward pass (`reference.max_tokens_per_micro_batch`, `auto` resolved), or None."""
        if budget == "auto" and not share_device:
            self.resolve_token_budget()

    def resolve_token_budget(self, reserved: float = 0.0) -> None:
        """Resolve `max_tokens_per_micro_batch: auto` from the device's free memory now, less `reserved` bytes that
        other parts will still allocate there while the reference scores (`auto_token_budget`). A set budget
        stays."""
        if self.cfg.max_tokens_per_micro_batch == "auto":
            self.token_budget = auto_token_budget(self.model, self.device, training=False,
                                                  field="reference.max_tokens_per_micro_batch", reserved=reserved)
            say(f"reference: max_tokens_per_micro_batch auto = {self.token_budget} tokens")

    def logprobs(self, sequences: Sequences) -> torch.Tensor:
        """`[B, T]` float32 on the CPU, 0 on padding: the batch (kept on the host) scored in micro-batches."""
        if self.token_budget is None and self.cfg.max_tokens_per_micro_batch == "auto":
            raise RuntimeError("reference.max_tokens_per_micro_batch 'auto' is not resolved yet: the process that "
                               "shares the device calls resolve_token_budget once every part is built")
        return score_in_micro_batches(self.model, sequences, self.temperature, self.cfg.micro_batch_size,
                                      self.token_budget, device=self.device)
