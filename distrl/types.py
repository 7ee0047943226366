"""Data contracts that cross actor boundaries.

Three stages, three types:
  `Prompt`     one dataset row, tokenized (data -> rollout actors, reward tasks)
  `Rollouts`   what vLLM produced, ragged per-sample lists (rollout actors -> driver)
  `TrainBatch` padded tensors the learner and reference consume (driver -> reference/learners)

Each has `validate()`; `split(n)` / `concat(parts)` live with the type so that actor groups stay generic.
Shapes: B sequences, P padded prompt length (left-padded), T padded response length (right-padded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from itertools import pairwise
from typing import Any

import torch


@dataclass(frozen=True)
class Prompt:
    """One prompt of the dataset.

    `index` is the row's position in the dataset; `text` is the rendered prompt (chat template applied);
    `sample` is the raw row (answer and any extra fields), handed to the reward function.
    """

    index: int
    text: str
    prompt_ids: list[int]
    answer: str | None = None
    sample: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rollouts:
    """Samples from a rollout actor: `n` responses per prompt, grouped contiguously (prompt-major).

    prompt_ids[i]        token ids of sample i's prompt
    response_ids[i]      sampled token ids, len L_i
    rollout_logprobs[i]  log-prob of each sampled token under the distribution sampled from, len L_i
    response_texts[i]    detokenized response
    finish_reasons[i]    "stop" (EOS or stop string) or "length"
    group[i]             position of the prompt in the step's prompt list (the group id of group estimators)
    policy_version       weights version that produced every sample
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    response_texts: list[str]
    finish_reasons: list[str]
    group: list[int]
    policy_version: int

    def __len__(self) -> int:
        return len(self.response_ids)

    def validate(self) -> Rollouts:
        n = len(self.response_ids)
        for f in ("prompt_ids", "rollout_logprobs", "response_texts", "finish_reasons", "group"):
            if len(getattr(self, f)) != n:
                raise ValueError(f"Rollouts.{f} has {len(getattr(self, f))} entries, response_ids has {n}")
        for i, (ids, lps) in enumerate(zip(self.response_ids, self.rollout_logprobs, strict=True)):
            if len(ids) != len(lps):
                raise ValueError(f"Rollouts sample {i}: {len(ids)} response tokens but {len(lps)} log-probs")
        return self

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        """Join parts in order; every part must come from the same policy version."""
        if not parts:
            raise ValueError("Rollouts.concat needs at least one part")
        versions = {p.policy_version for p in parts}
        if len(versions) != 1:
            raise ValueError(f"Rollouts.concat: parts come from different policy versions {sorted(versions)}")
        return Rollouts(
            **{f.name: [x for p in parts for x in getattr(p, f.name)]
               for f in fields(Rollouts) if f.name != "policy_version"},
            policy_version=parts[0].policy_version,
        ).validate()


_BATCH_TENSORS = ("input_ids", "attention_mask", "response_mask", "advantages", "rollout_logprobs",
                  "old_logprobs", "ref_logprobs")


@dataclass
class TrainBatch:
    """Padded batch for the reference and learners.

    input_ids         [B, P+T] long   prompt left-padded to P, then response right-padded to T
    attention_mask    [B, P+T] long   1 on real tokens
    response_mask     [B, T]   float  1 on response tokens that count in the loss
    advantages        [B, T]   float
    rollout_logprobs  [B, T]   float  vLLM's sampled-token log-probs (0 on padding)
    old_logprobs      [B, T]   float | None  trainer log-probs before the update
    ref_logprobs      [B, T]   float | None  reference-model log-probs
    policy_version    version of the weights that sampled the batch
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    advantages: torch.Tensor
    rollout_logprobs: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    policy_version: int = 0

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

    def validate(self) -> TrainBatch:
        b, s = self.input_ids.shape
        t = self.response_len
        if self.attention_mask.shape != (b, s):
            raise ValueError(f"TrainBatch.attention_mask is {tuple(self.attention_mask.shape)}, expected {(b, s)}")
        if t > s:
            raise ValueError(f"TrainBatch: response length {t} exceeds sequence length {s}")
        for name in _BATCH_TENSORS[2:]:
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != (b, t):
                raise ValueError(f"TrainBatch.{name} is {tuple(x.shape)}, expected {(b, t)}")
        return self

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TrainBatch:
        changes: dict[str, Any] = {n: fn(getattr(self, n)) for n in _BATCH_TENSORS if getattr(self, n) is not None}
        return replace(self, **changes)

    def to(self, device: torch.device | str) -> TrainBatch:
        return self._map(lambda x: x.to(device))

    def select(self, index: torch.Tensor | slice) -> TrainBatch:
        """Rows `index` of every tensor."""
        return self._map(lambda x: x[index])

    def split(self, n: int) -> list[TrainBatch]:
        """n contiguous shards whose sizes differ by at most one (equal when n divides B)."""
        if n <= 0 or n > self.batch_size:
            raise ValueError(f"TrainBatch.split: cannot split a batch of {self.batch_size} into {n} non-empty shards")
        bounds = [round(i * self.batch_size / n) for i in range(n + 1)]
        return [self.select(slice(a, b)) for a, b in pairwise(bounds)]

    def shard(self, n: int, mini_batch_size: int) -> list[TrainBatch]:
        """n data-parallel shards, mini-batch by mini-batch: shard k holds the k-th n-th of every consecutive
        `mini_batch_size` rows, so a learner's j-th chunk of `mini_batch_size // n` rows is its part of the global
        mini-batch j, and M learners take exactly the optimizer steps one learner would."""
        if self.batch_size % mini_batch_size or mini_batch_size % n:
            raise ValueError(f"TrainBatch.shard: a batch of {self.batch_size} does not split into mini-batches of "
                             f"{mini_batch_size} rows, each into {n} equal shards")
        parts = [mini.split(n) for mini in self.chunks(mini_batch_size)]
        return [TrainBatch.concat([p[k] for p in parts]) for k in range(n)]

    def chunks(self, size: int) -> list[TrainBatch]:
        """Consecutive slices of at most `size` rows (micro-batches)."""
        return [self.select(slice(i, i + size)) for i in range(0, self.batch_size, size)]

    @staticmethod
    def concat(parts: list[TrainBatch]) -> TrainBatch:
        """Stack shards along B; shards must share P and T and the policy version."""
        if not parts:
            raise ValueError("TrainBatch.concat needs at least one part")
        first = parts[0]
        kwargs: dict[str, Any] = {}
        for n in _BATCH_TENSORS:
            xs = [getattr(p, n) for p in parts]
            present = [x is not None for x in xs]
            if any(present) and not all(present):
                raise ValueError(f"TrainBatch.concat: {n} is set on some parts but not all")
            kwargs[n] = torch.cat(xs) if all(present) else None
        return TrainBatch(**kwargs, policy_version=first.policy_version).validate()
