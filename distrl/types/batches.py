"""The samples padded into tensors: `Sequences` (what the reference and learners score) and `TrainBatch` (what a
learner trains on), with the row operations both share (device moves, selection, shards, micro- and mini-batches).

Shapes: B sequences, P padded prompt length (left-padded), T padded response length (right-padded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from itertools import accumulate, pairwise
from typing import Any, TypeVar

import torch

from distrl.micro_batches import balanced_parts

R = TypeVar("R", "Sequences", "TrainBatch")


def _map_rows(batch: R, fn: Callable[[torch.Tensor], torch.Tensor]) -> R:
    """`fn` applied to every `[B, ...]` tensor of `batch` (nested `Sequences` included; absent tensors stay None)."""
    changes: dict[str, Any] = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            changes[f.name] = fn(value)
        elif isinstance(value, Sequences):
            changes[f.name] = _map_rows(value, fn)
    return replace(batch, **changes)


def on_host(batch: R) -> R:
    """`batch` itself when its tensors are in host memory, else copied there (once): where micro-batches and their
    packed layouts are made."""
    return batch if batch.response_mask.device.type == "cpu" else batch.to("cpu")


def _split_rows(batch: R, n: int) -> list[R]:
    """n contiguous shards whose sizes differ by at most one (equal when n divides B)."""
    size = batch.batch_size
    if n <= 0 or n > size:
        raise ValueError(f"{type(batch).__name__}.split: cannot split a batch of {size} into {n} non-empty shards")
    bounds = [round(i * size / n) for i in range(n + 1)]
    return [batch.select(slice(a, b)) for a, b in pairwise(bounds)]


def _chunk_rows(batch: R, size: int) -> list[R]:
    return [batch.select(slice(i, i + size)) for i in range(0, batch.batch_size, size)]


def mini_batch_bounds(size: int, mini_batches: int, n: int = 1) -> list[int]:
    """Row bounds of `mini_batches` contiguous mini-batches of a batch of `size` rows (sizes that differ by at most
    one), each of at least one row for each of n learners: the rows of each optimizer step (`TrainBatch.shard`)."""
    if mini_batches <= 0 or n <= 0 or size < mini_batches * n:
        raise ValueError(f"TrainBatch.shard: a batch of {size} rows does not make {mini_batches} mini-batches of at "
                         f"least one row for each of {n} learners")
    return [round(j * size / mini_batches) for j in range(mini_batches + 1)]


def in_row_order(parts: list[torch.Tensor], rows: list[torch.Tensor]) -> torch.Tensor:
    """Per-row results of the shards (`parts[k]`, `[b_k, ...]`, for the rows `rows[k]` of `TrainBatch.shard_rows`)
    in the batch's row order: `[B, ...]`."""
    index = torch.cat(rows)
    out = torch.empty((len(index), *parts[0].shape[1:]), dtype=parts[0].dtype)
    out[index] = torch.cat(parts)
    return out


@dataclass(frozen=True)
class Sequences:
    """Padded samples, as the reference and learners score them.

    input_ids         [B, P+T] long   prompt left-padded to P, then response right-padded to T
    attention_mask    [B, P+T] long   1 on real tokens
    response_mask     [B, T]   float  1 on response tokens that count in the loss
    rollout_logprobs  [B, T]   float  the sampler's log-probs of the sampled tokens (0 on padding and observations)
    policy_version    [B]      long   the oldest version of the weights among each sample's trained tokens
    response_versions [B, T]   long   version of the weights that sampled each response token (0 on padding)
    routes            [B, P+T, L, k]  uint8 or int16  rollout routing replay: the k experts each of the L MoE layers
                                      of the engine routed each token to, in the columns of `input_ids`; None
                                      without routes (every router then chooses its own)
    routed            [B, P+T] bool   the tokens `routes` holds (padding, a sample's last token and tokens the
                                      engine gave no route are False: their routers choose their own); None
                                      without routes
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    policy_version: torch.Tensor
    response_versions: torch.Tensor
    routes: torch.Tensor | None = None
    routed: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        """T: padded response length."""
        return self.response_mask.shape[1]

    @property
    def prompt_len(self) -> int:
        """P: padded prompt length."""
        return self.input_ids.shape[1] - self.response_len

    def validate(self) -> Sequences:
        b, s = self.input_ids.shape
        t = self.response_len
        if self.attention_mask.shape != (b, s):
            raise ValueError(f"Sequences.attention_mask is {tuple(self.attention_mask.shape)}, expected {(b, s)}")
        if t > s:
            raise ValueError(f"Sequences: response length {t} exceeds sequence length {s}")
        for name in ("response_mask", "rollout_logprobs", "response_versions"):
            if tuple(getattr(self, name).shape) != (b, t):
                raise ValueError(f"Sequences.{name} is {tuple(getattr(self, name).shape)}, expected {(b, t)}")
        if tuple(self.policy_version.shape) != (b,):
            raise ValueError(f"Sequences.policy_version is {tuple(self.policy_version.shape)}, expected {(b,)}")
        if (self.routes is None) != (self.routed is None):
            raise ValueError("Sequences: routes and routed come together, or neither")
        if self.routes is not None and self.routed is not None:
            if self.routes.dim() != 4 or tuple(self.routes.shape[:2]) != (b, s):
                raise ValueError(f"Sequences.routes is {tuple(self.routes.shape)}, expected {(b, s)} + (layers, k)")
            if tuple(self.routed.shape) != (b, s) or self.routed.dtype != torch.bool:
                raise ValueError(f"Sequences.routed is {tuple(self.routed.shape)} {self.routed.dtype}, expected "
                                 f"{(b, s)} bool")
        return self

    def to(self, device: torch.device | str) -> Sequences:
        return _map_rows(self, lambda x: x.to(device))

    def select(self, index: torch.Tensor | slice) -> Sequences:
        """Rows `index` of every tensor."""
        return _map_rows(self, lambda x: x[index])

    def split(self, n: int) -> list[Sequences]:
        """n contiguous shards whose sizes differ by at most one."""
        return _split_rows(self, n)

    def chunks(self, size: int) -> list[Sequences]:
        """Consecutive slices of at most `size` rows (micro-batches)."""
        return _chunk_rows(self, size)

    @staticmethod
    def concat(parts: list[Sequences]) -> Sequences:
        """Stack shards along B; shards must share P and T, and all have routes or none."""
        if not parts:
            raise ValueError("Sequences.concat needs at least one part")
        if len({p.routes is None for p in parts}) > 1:
            raise ValueError("Sequences.concat: routes are set on some parts but not all")
        joined: dict[str, Any] = {f.name: None if getattr(parts[0], f.name) is None else
                                  torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Sequences)}
        return Sequences(**joined)


@dataclass(frozen=True)
class TrainBatch:
    """Everything a learner needs for one update, complete at construction.

    sequences     the padded samples (`Sequences`)
    old_logprobs  [B, T] float  the proximal policy's log-probs: the learners' own before the update (decoupled
                                PPO), or the sampler's in bypass mode; None when the update is one optimizer step
                                that takes them from its own forward pass (`Config.old_logprobs_in_update`)
    advantages    [B, T] float
    ref_logprobs  [B, T] float, or None when no KL term uses the reference model
    old_values    [B, T] float  the critic's values before the update (GAE; the value loss clips around them), or
                                None without a critic
    returns       [B, T] float  GAE's returns, the critic's targets (None without a critic)
    mini_batch    [B] long      which global mini-batch (optimizer step) each row belongs to, 0, 1, ... in row
                                order; set by `shard`, so that every learner takes the same steps when a batch's rows
                                do not divide evenly. None: consecutive mini-batches of a fixed size (`mini_batches`)
    cov_selected  [B, T] bool   the tokens Clip-Cov / KL-Cov act on, selected over each mini-batch's rows before the
                                batch is split (`distrl.batching.select_by_covariance`), or None for other losses
    """

    sequences: Sequences
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    mini_batch: torch.Tensor | None = None
    cov_selected: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def batch_size(self) -> int:
        return self.sequences.batch_size

    @property
    def response_mask(self) -> torch.Tensor:
        return self.sequences.response_mask

    @property
    def rollout_logprobs(self) -> torch.Tensor:
        return self.sequences.rollout_logprobs

    def validate(self) -> TrainBatch:
        expected = tuple(self.sequences.response_mask.shape)
        if (self.old_values is None) != (self.returns is None):
            raise ValueError("TrainBatch: old_values and returns come together (the critic's), or neither")
        for name in ("old_logprobs", "advantages", "ref_logprobs", "old_values", "returns", "cov_selected"):
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != expected:
                raise ValueError(f"TrainBatch.{name} is {tuple(x.shape)}, expected {expected}")
        if self.mini_batch is not None:
            if tuple(self.mini_batch.shape) != expected[:1]:
                raise ValueError(f"TrainBatch.mini_batch is {tuple(self.mini_batch.shape)}, expected {expected[:1]}")
            if self.mini_batch.numel() and bool((self.mini_batch.diff() < 0).any()):
                raise ValueError(f"TrainBatch.mini_batch {self.mini_batch.tolist()} is not in row order")
        return self

    def to(self, device: torch.device | str) -> TrainBatch:
        return _map_rows(self, lambda x: x.to(device))

    def select(self, index: torch.Tensor | slice) -> TrainBatch:
        """Rows `index` of every tensor."""
        return _map_rows(self, lambda x: x[index])

    def split(self, n: int) -> list[TrainBatch]:
        """n contiguous shards whose sizes differ by at most one."""
        return _split_rows(self, n)

    def chunks(self, size: int) -> list[TrainBatch]:
        """Consecutive slices of at most `size` rows (micro-batches)."""
        return _chunk_rows(self, size)

    def shard(self, n: int, mini_batches: int, rows: list[torch.Tensor] | None = None) -> list[TrainBatch]:
        """n data-parallel shards of `mini_batches` mini-batches (the config's optimizer steps per pass): shard k
        is the rows `shard_rows(n, mini_batches)[k]` (`rows`, when the caller has them already), each labelled with
        its mini-batch (`mini_batch`), so every learner takes the same optimizer steps, each on its part of the same
        global mini-batch, and M learners take exactly the steps one learner would (the loss divides by counts
        all-reduced over the learners, so parts of any size weigh their rows as one learner would)."""
        bounds = mini_batch_bounds(self.batch_size, mini_batches, n)
        labels = torch.cat([torch.full((b - a,), j, dtype=torch.long) for j, (a, b) in enumerate(pairwise(bounds))])
        labelled = replace(self, mini_batch=labels)
        return [labelled.select(part) for part in (rows if rows is not None else self.shard_rows(n, mini_batches))]

    def shard_rows(self, n: int, mini_batches: int) -> list[torch.Tensor]:
        """The rows (indices into this batch, `[b_k]` long, ascending) of each of n data-parallel shards: the B rows
        are cut into `mini_batches` contiguous mini-batches whose sizes differ by at most one, and each mini-batch's
        rows are dealt to the n shards by their real tokens, longest first, each to the shard with the fewest
        tokens so far among those with room (`distrl.micro_batches.balanced_parts`), a shard taking as many rows
        as the k-th of n contiguous parts would (sizes that differ by at most one). Shard k's rows are its rows of
        mini-batch 0, then of mini-batch 1, ...; `in_row_order` puts per-row results of the shards back in the
        batch's order."""
        lengths = self.sequences.attention_mask.sum(-1).tolist()
        shards: list[list[int]] = [[] for _ in range(n)]
        for a, b in pairwise(mini_batch_bounds(self.batch_size, mini_batches, n)):
            sizes = [round((k + 1) * (b - a) / n) - round(k * (b - a) / n) for k in range(n)]
            for k, part in enumerate(balanced_parts(lengths[a:b], sizes)):
                shards[k] += [a + i for i in part]
        return [torch.tensor(rows, dtype=torch.long) for rows in shards]

    def mini_batches(self, size: int) -> list[TrainBatch]:
        """This (shard of a) batch's mini-batches, one per optimizer step, in order: the rows of each `mini_batch`
        label, or consecutive slices of `size` rows when the batch has no labels."""
        if self.mini_batch is None:
            return self.chunks(size)
        counts = torch.bincount(self.mini_batch).tolist()
        if 0 in counts:
            raise ValueError(f"TrainBatch.mini_batches: no row of mini-batch {counts.index(0)} "
                             f"(labels {self.mini_batch.tolist()})")
        bounds = [0, *accumulate(counts)]
        return [self.select(slice(a, b)) for a, b in pairwise(bounds)]

    @staticmethod
    def concat(parts: list[TrainBatch]) -> TrainBatch:
        """Stack shards along B; every part has old (reference) log-probs, old values and returns, mini-batch labels,
        covariance selections, or none has."""
        if not parts:
            raise ValueError("TrainBatch.concat needs at least one part")

        def stacked(name: str) -> torch.Tensor | None:
            xs = [getattr(p, name) for p in parts]
            if all(x is None for x in xs):
                return None
            if any(x is None for x in xs):
                raise ValueError(f"TrainBatch.concat: {name} is set on some parts but not all")
            return torch.cat(xs)

        return TrainBatch(
            sequences=Sequences.concat([p.sequences for p in parts]),
            old_logprobs=stacked("old_logprobs"),
            advantages=torch.cat([p.advantages for p in parts]),
            ref_logprobs=stacked("ref_logprobs"),
            old_values=stacked("old_values"),
            returns=stacked("returns"),
            mini_batch=stacked("mini_batch"),
            cov_selected=stacked("cov_selected"),
        )
