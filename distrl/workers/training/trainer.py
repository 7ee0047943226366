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
from dataclasses import dataclass, fields
from itertools import pairwise

import numpy as np
import torch

from distrl import checkpoint
from distrl.config import LearnerConfig
from distrl.console import say
from distrl.merging import Figure, Figures, Merge, merge, over_steps
from distrl.micro_batches import micro_batches
from distrl.types.batches import Sequences, TrainBatch, on_host
from distrl.workers.device import to_device
from distrl.workers.training import dist
from distrl.workers.training.optim import build_optimizer
from distrl.workers.training.packing import Layout, host_layout
from distrl.workers.training.strategy import Replicated
from distrl.workers.training.token_budget import auto_token_budget
from distrl.workers.weights.hf_export import HFExport


@dataclass(frozen=True)
class Counts:
    """Global normalisers of one mini-batch: response tokens and non-empty sequences on every learner together."""

    num_tokens: float
    num_seqs: float


Measured = dict[str, tuple[torch.Tensor, Merge]]
"""Figures of one micro-batch still on the device: 0-dim tensors, each with how it merges (`distrl.merging`)."""

Objective = Callable[[torch.nn.Module, TrainBatch, Counts, Layout], tuple[torch.Tensor, Measured]]
"""The loss of one micro-batch `(model, micro, counts, layout) -> (loss, figures)`: a scalar whose sum over the
micro-batches of every learner is the mini-batch's loss (divide by `counts`), and its figures, left on the device.
`micro` is on the trainer's device; `layout` is its packed layout there (`distrl.workers.training.packing`)."""


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient norm."""


class Trainer:
    """`model` trained by AdamW under `cfg`'s schedule; `update(batch, objective)` runs `cfg.ppo_epochs` passes of one
    optimizer step per mini-batch. `strategy` (built the model and) says how the learners share it; `role` names
    the trained model in figures and errors ("learner", "critic"); `share_device`: other parts of this process will
    share the device, and an `auto` token budget waits for `resolve_token_budget`.

    The host waits for the device once per optimizer step (and once per update with several learners, for the
    global counts and the lockstep's forward passes, read together): batches stay on the host, where micro-batches
    and their packed layouts are made and moved to the device without a wait (`distrl.workers.training.packing`);
    losses, figures, the non-finite flag and the gradient norm stay on the device until the step reads them together, to
    decide whether to apply it."""

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, total_optimizer_steps: int, device: str,
                 global_mini_batch_size: int, strategy: Replicated, role: str = "learner",
                 share_device: bool = False):
        self.model, self.cfg, self.device, self.role = model, cfg, device, role
        self.strategy = strategy
        self.global_mini_batch_size = global_mini_batch_size
        # Master weights and optimizer state stay float32; a lower cfg.dtype is the compute dtype (pure bf16
        # weights would round most Adam updates of size ~lr away), the weights cast once per forward pass.
        strategy.cast_weights(model)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable()  # type: ignore[operator]
            model.config.use_cache = False  # type: ignore[union-attr]
        model.train()
        self.params = [p for p in model.parameters() if p.requires_grad]
        budget = cfg.max_tokens_per_micro_batch
        self.token_budget: int | None = None if budget == "auto" else budget
        """Tokens of one forward pass (`max_tokens_per_micro_batch`, `auto` resolved), None for fixed counts."""
        if budget == "auto" and not share_device:
            self.resolve_token_budget()
        self.optimizer, self.scheduler = build_optimizer(model, cfg, total_optimizer_steps, device)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.consecutive_nonfinite = 0
        self.micro_rows: list[list[int]] = []

    def resolve_token_budget(self, reserved: float = 0.0) -> None:
        """Resolve `max_tokens_per_micro_batch: auto` from the device's free memory now (`auto_token_budget`), less
        `reserved` bytes that other parts of the process will still allocate on the device while this one trains:
        at construction, or (`share_device`) once those parts are built (a hybrid actor). A set budget stays."""
        if self.cfg.max_tokens_per_micro_batch == "auto":
            self.token_budget = auto_token_budget(self.model, self.device, training=True,
                                                  checkpointing=self.cfg.gradient_checkpointing,
                                                  field=f"{self.role}.max_tokens_per_micro_batch", reserved=reserved,
                                                  sequence_parallel=self.cfg.sequence_parallel_size)
            say(f"{self.role}: max_tokens_per_micro_batch auto = {self.token_budget} tokens")

    @property
    def local_mini_batch_size(self) -> int:
        """Rows of one mini-batch on this learner."""
        return self.global_mini_batch_size // dist.data_parallel_size()

    # ------------------------------------------------------------------------------------------------ training
    def update(self, batch: TrainBatch, objective: Objective) -> Figures:
        """`cfg.ppo_epochs` passes over this learner's shard of the step batch (on the host), one optimizer step per
        mini-batch: the rows `TrainBatch.shard` labelled j are its part of global mini-batch j (the parts of one
        mini-batch may differ by a row between learners when the batch's rows do not divide evenly); an unlabelled
        batch is cut into chunks of `local_mini_batch_size` rows. Returns the figures merged over steps
        (`over_steps`), plus this update's `<role>/*` figures."""
        batch = on_host(batch)
        minis = self.mini_batch_rows(batch)
        mask = batch.response_mask.numpy()
        tokens = [float(mask[rows].sum()) for rows in minis]
        counts, groups = self._plan(batch, minis)
        steps: list[Figures] = []
        for _ in range(self.cfg.ppo_epochs):
            for rows, count, micro in zip(minis, counts, groups, strict=True):
                steps.append(self.step(batch, rows, objective, count, micro))
        figs = over_steps(steps, tokens * self.cfg.ppo_epochs)
        figs.update({f"{self.role}/lr": Figure(self.scheduler.get_last_lr()[0], Merge.MEAN),
                     f"{self.role}/skipped_steps": Figure(self.skipped_steps, Merge.MAX),
                     f"{self.role}/optimizer_steps": Figure(self.optimizer_steps, Merge.MAX),
                     f"{self.role}/tokens": Figure(float(mask.sum()), Merge.SUM)})
        return figs

    def mini_batch_rows(self, batch: TrainBatch) -> list[np.ndarray]:
        """The rows of each of the batch's mini-batches, in order (`TrainBatch.mini_batches`, on the host): the
        rows of each `mini_batch` label, or consecutive chunks of `local_mini_batch_size` rows."""
        n = batch.batch_size
        if batch.mini_batch is None:
            size = self.local_mini_batch_size
            return [np.arange(i, min(i + size, n)) for i in range(0, n, size)]
        labels = batch.mini_batch.numpy()
        counts = np.bincount(labels)
        if (counts == 0).any():
            raise ValueError(f"TrainBatch.mini_batches: no row of mini-batch {int(np.argmin(counts))} "
                             f"(labels {labels.tolist()})")
        bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
        return [np.arange(a, b) for a, b in pairwise(bounds)]

    def _plan(self, batch: TrainBatch, minis: list[np.ndarray]) -> tuple[list[Counts], list[list[list[int]]]]:
        """Each mini-batch's `Counts` over every learner, and this learner's micro-batches of it (`micro_batches`),
        as many as the strategy's lockstep asks: the counts from the host mask summed over the group, and the
        forward passes each learner needs reduced by the strategy, both read at once (the update's one wait for the
        group, with several learners)."""
        mask = batch.response_mask.numpy()
        lengths = batch.sequences.attention_mask.numpy().sum(-1)
        groups = [self._groups(lengths[rows].tolist()) for rows in minis]
        local = [(float(mask[rows].sum()), float((mask[rows].sum(-1) > 0).sum())) for rows in minis]
        passes = [len(g) for g in groups]
        if dist.world_size() > 1:
            summed = dist.all_reduce_(to_device(torch.tensor(local, dtype=torch.float64), self.device),
                                      group=dist.data_group())  # each row once: not over a sequence group
            most = self.strategy.lockstep(to_device(torch.tensor(passes, dtype=torch.float64), self.device))
            read = torch.cat([summed.flatten(), most]).tolist()  # the wait
            local = [tuple(read[2 * j:2 * j + 2]) for j in range(len(minis))]
            passes = [int(n) for n in read[2 * len(minis):]]
        groups = [g if n == len(g) else self._groups(lengths[rows].tolist(), n)
                  for rows, g, n in zip(minis, groups, passes, strict=True)]
        return [Counts(*pair) for pair in local], groups

    def step(self, batch: TrainBatch, rows: np.ndarray, objective: Objective, counts: Counts,
             micro_rows: list[list[int]]) -> Figures:
        """One optimizer step on this learner's part `rows` of a mini-batch of `batch` (on the host), in the
        micro-batches `micro_rows` (positions in `rows`; kept in `self.micro_rows`, in the order the objective sees
        them): they accumulate gradients, which are summed over the learner group, clipped, and applied unless the
        loss or the norm is not finite. Figures merged over micro-batches; loss terms (`Merge.SUM`) summed over the
        group too, so they are the step's."""
        mask = batch.response_mask.numpy()
        self.micro_rows = micro_rows
        parts: list[Measured] = []
        part_tokens: list[float] = []
        nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        split = dist.sequence_split()
        for group in micro_rows:
            index = torch.from_numpy(rows[group]).long()  # empty for a micro-batch added for lockstep
            layout = host_layout(batch.sequences.select(index))
            layout = (layout.split(split) if split else layout).to(self.device)
            loss, part = objective(self.model, _rows_on(batch, index, self.device), counts, layout)
            nonfinite |= ~torch.isfinite(loss.detach())
            loss.backward()
            parts.append(part)
            part_tokens.append(float(mask[rows[group]].sum()))
        self.strategy.reduce_grads(self.params)
        keys = list(parts[0])
        sums = [key for key in keys if parts[0][key][1] is Merge.SUM]
        # Summed over the group, a loss term is the step's own figure, the same on every learner; the learners of a
        # sequence-parallel group each computed the same loss, so it is summed over one of them per data group.
        reduced = dist.all_reduce_(torch.stack([nonfinite.double(), *(torch.stack([p[k][0] for p in parts]).double()
                                                                     .sum() for k in sums)]), group=dist.data_group())
        grad_norm = self.strategy.clip(self.params, self.cfg.max_grad_norm)
        read = torch.cat([reduced, grad_norm.double().view(1),
                          *(torch.stack([p[k][0].double() for k in keys]) for p in parts)]).tolist()  # the wait
        grad_norm_value = read[len(reduced)]
        values = read[len(reduced) + 1:]
        width = len(keys)
        host = [{k: Figure(values[i * width + j], parts[0][k][1]) for j, k in enumerate(keys)}
                for i in range(len(parts))]
        # A micro-batch without response tokens (added for lockstep, or all its responses empty) measured nothing:
        # its means are 0 / 0.
        measured = [i for i, tokens in enumerate(part_tokens) if tokens > 0] or list(range(len(parts)))
        figs = merge([host[i] for i in measured], [part_tokens[i] for i in measured])
        figs.update({key: Figure(value, Merge.MEAN) for key, value in zip(sums, read[1:len(reduced)], strict=True)})
        if read[0] > 0 or not math.isfinite(grad_norm_value):
            self._skip(grad_norm_value)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
            self.consecutive_nonfinite = 0
        self.optimizer.zero_grad(set_to_none=True)
        figs[f"{self.role}/grad_norm"] = Figure(grad_norm_value, Merge.MEAN)
        return figs

    def micro_batches(self, sequences: Sequences) -> list[list[int]]:
        """Row groups of `sequences` (on the host), one per forward pass of a scoring call (`_groups`), as many as
        the strategy's lockstep asks: sharded learners agree on the most any of them needs (the call's one wait
        for the group)."""
        lengths = sequences.attention_mask.numpy().sum(-1).tolist()
        groups = self._groups(lengths)
        if not self.strategy.sharded or dist.world_size() == 1:
            return groups
        most = self.strategy.lockstep(to_device(torch.tensor([len(groups)], dtype=torch.float64), self.device))
        need = int(most.tolist()[0])  # the wait
        return groups if need == len(groups) else self._groups(lengths, need)

    def _groups(self, lengths: list[int], min_count: int = 1) -> list[list[int]]:
        """Row groups of rows with `lengths` real tokens (`distrl.micro_batches`: by the token budget when set, else
        `micro_batch_size` rows), at least `min_count` of them."""
        if self.token_budget is None and self.cfg.max_tokens_per_micro_batch == "auto":
            raise RuntimeError(f"{self.role}.max_tokens_per_micro_batch 'auto' is not resolved yet: the process that "
                               f"shares the device calls resolve_token_budget once every part is built")
        return micro_batches(lengths, self.cfg.micro_batch_size, self.token_budget, min_count)

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


def _rows_on(batch: TrainBatch, index: torch.Tensor, device: str) -> TrainBatch:
    """Rows `index` of `batch` (on the host) on `device`, copied without a wait (`to_device`), mini-batch labels
    and routes left behind."""
    def move(x: torch.Tensor) -> torch.Tensor:
        return to_device(x[index], device)

    def maybe(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else move(x)

    # Routes reach the forward pass in the packed layout (`host_layout`), not here: not copied twice.
    seqs = Sequences(**{f.name: move(getattr(batch.sequences, f.name)) for f in fields(Sequences)
                        if f.name not in ("routes", "routed")})
    return TrainBatch(seqs, old_logprobs=maybe(batch.old_logprobs), advantages=move(batch.advantages),
                      ref_logprobs=maybe(batch.ref_logprobs), old_values=maybe(batch.old_values),
                      returns=maybe(batch.returns), cov_selected=maybe(batch.cov_selected))
