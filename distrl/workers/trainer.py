"""The training core shared by the policy learner and the critic: a model, its AdamW and schedule, and optimizer
steps on (mini-)batches with a given objective. Plain class, no Ray.

What is written once here: micro-batching, the global normalisers, gradient reduction across the learner group,
clipping, skipping non-finite steps, the optimizer step, how the figures merge, and the state a checkpoint needs.
What differs between the policy and the critic is the objective: the loss of one micro-batch.

Normalisation is global: every micro-batch's loss is divided by the token and sequence counts of the whole
mini-batch *across all learners* (handed to the objective), and gradients are summed across learners, so M learners x
k micro-batches produce exactly the gradient of one full-batch loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from distrl import checkpoint
from distrl.config import LearnerConfig
from distrl.merging import Figure, Figures, Merge, merge, over_steps
from distrl.micro_batches import micro_batches
from distrl.types.batches import Sequences, TrainBatch
from distrl.workers import dist
from distrl.workers.hf_export import HFExport
from distrl.workers.optim import build_optimizer
from distrl.workers.strategy import Replicated


@dataclass(frozen=True)
class Counts:
    """Global normalisers of one mini-batch: response tokens and non-empty sequences on every learner together."""

    num_tokens: float
    num_seqs: float


Objective = Callable[[torch.nn.Module, TrainBatch, Counts], tuple[torch.Tensor, Figures]]
"""The loss of one micro-batch `(model, micro, counts) -> (loss, figures)`: a scalar whose sum over the micro-batches
of every learner is the mini-batch's loss (divide by `counts`), and its figures, each saying how it merges."""


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient norm."""


class Trainer:
    """`model` trained by AdamW under `cfg`'s schedule; `update(batch, objective)` runs `cfg.ppo_epochs` passes of one
    optimizer step per mini-batch. `strategy` (built the model and) says how the learners share it; `role` names
    the trained model in figures and errors ("learner", "critic")."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, total_optimizer_steps: int, device: str,
                 global_mini_batch_size: int, strategy: Replicated, role: str = "learner"):
        self.model, self.cfg, self.device, self.role = model, cfg, device, role
        self.strategy = strategy
        self.global_mini_batch_size = global_mini_batch_size
        # Master weights and optimizer state stay float32; a lower cfg.dtype is the compute dtype (pure bf16
        # weights would round most Adam updates of size ~lr away).
        self.autocast = strategy.autocast()
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()  # type: ignore[operator]
            model.config.use_cache = False  # type: ignore[union-attr]
        model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_optimizer_steps)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.consecutive_nonfinite = 0
        self.micro_rows: list[list[int]] = []

    @property
    def local_mini_batch_size(self) -> int:
        """Rows of one mini-batch on this learner."""
        return self.global_mini_batch_size // dist.world_size()

    # ------------------------------------------------------------------------------------------------ training
    def update(self, batch: TrainBatch, objective: Objective) -> Figures:
        """`cfg.ppo_epochs` passes over this learner's shard of the step batch, one optimizer step per mini-batch:
        the rows `TrainBatch.shard` labelled j are its part of global mini-batch j (the parts of one mini-batch may
        differ by a row between learners when the batch's rows do not divide evenly); an unlabelled batch is cut
        into chunks of `local_mini_batch_size` rows. Returns the figures merged over steps (`over_steps`), plus
        this update's `<role>/*` figures."""
        steps: list[Figures] = []
        tokens: list[float] = []
        minis = batch.mini_batches(self.local_mini_batch_size)
        for _ in range(self.cfg.ppo_epochs):
            for mini in minis:
                steps.append(self.step(mini, objective))
                tokens.append(float(mini.response_mask.sum()))
        figs = over_steps(steps, tokens)
        figs.update({f"{self.role}/lr": Figure(self.scheduler.get_last_lr()[0], Merge.MEAN),
                     f"{self.role}/skipped_steps": Figure(self.skipped_steps, Merge.MAX),
                     f"{self.role}/optimizer_steps": Figure(self.optimizer_steps, Merge.MAX),
                     f"{self.role}/tokens": Figure(float(batch.response_mask.sum()), Merge.SUM)})
        return figs

    def step(self, mini: TrainBatch, objective: Objective) -> Figures:
        """One optimizer step on this learner's part of a mini-batch: micro-batches accumulate gradients, which are
        summed over the learner group, clipped, and applied unless the loss or the norm is not finite. Figures
        merged over micro-batches; loss terms (`Merge.SUM`) summed over the group too, so they are the step's."""
        mask = mini.response_mask
        # Global normalisers: counts over this mini-batch on every learner.
        counts = dist.all_reduce_(torch.stack([mask.sum(), (mask.sum(-1) > 0).sum().to(mask.dtype)]).double())
        global_counts = Counts(*counts.tolist())
        parts: list[Figures] = []
        part_tokens: list[float] = []
        nonfinite_loss = 0.0
        self.micro_rows = self.micro_batches(mini.sequences)
        for rows in self.micro_rows:
            micro = mini.select(torch.tensor(rows, dtype=torch.long, device=mask.device))
            with self.autocast:
                loss, figs = objective(self.model, micro, global_counts)
            if not torch.isfinite(loss):
                nonfinite_loss = 1.0
            loss.backward()
            parts.append(figs)
            part_tokens.append(float(micro.response_mask.sum()))
        # A micro-batch without response tokens (added for lockstep, or all its responses empty) measured nothing:
        # its means are 0 / 0.
        measured = [i for i, tokens in enumerate(part_tokens) if tokens > 0] or list(range(len(parts)))
        figs = merge([parts[i] for i in measured], [part_tokens[i] for i in measured])
        self.strategy.reduce_grads(self.params)
        sums = [key for key, fig in figs.items() if fig.merge is Merge.SUM]
        reduced = dist.all_reduce_(torch.tensor([nonfinite_loss, *(figs[k].value for k in sums)],
                                                dtype=torch.float64, device=self.device)).tolist()
        # Summed over the group, a loss term is the step's own figure, the same on every learner.
        figs.update({key: Figure(value, Merge.MEAN) for key, value in zip(sums, reduced[1:], strict=True)})
        grad_norm = self.strategy.clip(self.params, self.cfg.max_grad_norm)
        if reduced[0] > 0 or not math.isfinite(grad_norm):
            self._skip(grad_norm)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
            self.consecutive_nonfinite = 0
        self.optimizer.zero_grad(set_to_none=True)
        figs[f"{self.role}/grad_norm"] = Figure(grad_norm, Merge.MEAN)
        return figs

    def micro_batches(self, sequences: Sequences) -> list[list[int]]:
        """Row groups of `sequences`, one per forward pass (`distrl.micro_batches`: by the token budget
        `max_tokens_per_micro_batch` when set, else `micro_batch_size` rows), as many as the strategy's lockstep
        asks. `step` keeps those of its last call in `micro_rows`, in the order the objective saw them."""
        lengths = sequences.attention_mask.sum(-1).tolist()
        rows = micro_batches(lengths, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)
        need = self.strategy.lockstep(len(rows))
        return rows if need == len(rows) else micro_batches(lengths, self.cfg.micro_batch_size,
                                                            self.cfg.max_tokens_per_micro_batch, need)

    def _skip(self, grad_norm: float) -> None:
        self.skipped_steps += 1
        self.consecutive_nonfinite += 1
        if self.consecutive_nonfinite >= self.cfg.max_consecutive_nonfinite:
            raise NonFiniteError(
                f"{self.role}: {self.consecutive_nonfinite} consecutive optimizer steps had a non-finite loss or "
                f"gradient norm (last grad norm {grad_norm}); stopping ({self.role}.max_consecutive_nonfinite="
                f"{self.cfg.max_consecutive_nonfinite}). Lower {self.role}.lr or check the rewards/advantages."
            )

    # -------------------------------------------------------------------------------------------------- state
    def save(self, directory: str, hf: HFExport | None) -> checkpoint.FileList:
        """Write this trainer's part of a checkpoint to `directory` (`Replicated.save` / `Sharded.save`): weights
        (and with `hf` an HF copy), optimizer, schedule and step counters. Every learner calls it; each returns the
        files it wrote, with sizes and digests (`checkpoint.describe`), for the driver's manifest."""
        state = {"scheduler": self.scheduler.state_dict(), "optimizer_steps": self.optimizer_steps,
                 "skipped_steps": self.skipped_steps, "consecutive_nonfinite": self.consecutive_nonfinite,
                 "strategy": self.strategy.name}
        return self.strategy.save(directory, self.model, self.optimizer, state, hf)

    def load(self, directory: str) -> None:
        """Continue from the part `save` wrote in `directory`. Every learner calls it."""
        saved = checkpoint.load_trainer_state(directory)
        if saved.get("strategy", "replicate") != self.strategy.name:
            raise RuntimeError(
                f"checkpoint {directory} was written by {self.role}s with {self.role}.strategy "
                f"'{saved.get('strategy', 'replicate')}', and this run has '{self.strategy.name}': resume with the "
                f"strategy it was written with (its policy is also in HF format under policy/model/ for a new run)")
        state = self.strategy.load(directory, self.model, self.optimizer, saved)
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps, self.skipped_steps = state["optimizer_steps"], state["skipped_steps"]
        self.consecutive_nonfinite = state["consecutive_nonfinite"]
