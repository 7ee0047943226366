"""Reference worker: a frozen copy of the initial policy that scores batches for the KL term. Plain class, no Ray.

With `reference.sequence_parallel_size` k > 1 the reference actors join a process group of their own (`connect`), in
groups of k consecutive ranks that each score one part of the batch: every actor of a group gets the same rows, forms
the same micro-batches, holds 1/k of each packed row's tokens (`distrl.workers.training.ulysses`) and returns the
whole part's log-probs, gathered over its group (the caller keeps one answer per group)."""

from __future__ import annotations

import atexit

import torch

from distrl.config import ModelConfig, ReferenceConfig
from distrl.console import say
from distrl.types.batches import Sequences
from distrl.workers.device import granted_device
from distrl.workers.training import dist
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
                                                  field="reference.max_tokens_per_micro_batch", reserved=reserved,
                                                  sequence_parallel=self.cfg.sequence_parallel_size)
            say(f"reference: max_tokens_per_micro_batch auto = {self.token_budget} tokens")

    def logprobs(self, sequences: Sequences) -> torch.Tensor:
        """`[B, T]` float32 on the CPU, 0 on padding: the batch (kept on the host) scored in micro-batches."""
        if self.token_budget is None and self.cfg.max_tokens_per_micro_batch == "auto":
            raise RuntimeError("reference.max_tokens_per_micro_batch 'auto' is not resolved yet: the process that "
                               "shares the device calls resolve_token_budget once every part is built")
        return score_in_micro_batches(self.model, sequences, self.temperature, self.cfg.micro_batch_size,
                                      self.token_budget, device=self.device, split=self._split())

    def _split(self):
        """This actor's place in its group of k, or None: a hybrid actor's process holds its learner's group, whose
        split is not the reference's."""
        return dist.sequence_split() if self.cfg.sequence_parallel_size > 1 else None

    # ------------------------------------------------------------------------------------ sequence parallelism
    def connect(self, master_addr: str, master_port: int, rank: int, world_size: int,
                timeout_s: float = dist.default_pg_timeout.total_seconds()) -> str:
        """Join the reference actors' process group, in groups of `reference.sequence_parallel_size` (module
        docstring); returns the backend (gloo on CPU, NCCL on GPU). `timeout_s` bounds each of its collectives."""
        backend = dist.init_process_group(master_addr, master_port, rank, world_size, self.device, timeout_s,
                                          self.cfg.sequence_parallel_size)
        atexit.register(self.close)  # a graceful exit leaves the group first (`Learner.close` says why)
        return backend

    def close(self) -> None:
        """Leave the reference actors' group, ending its threads while the interpreter runs."""
        atexit.unregister(self.close)
        dist.leave_process_group()

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` (this actor's node): the rendezvous of the reference actors' group."""
        return dist.free_port(host)
