"""Data contracts that cross actor boundaries.

Each stage has its own type, built once and complete (no field is filled in later):
  `Prompt`          one dataset row, tokenized (data -> rollout actors, reward tasks)
  `Rollouts`        what an engine produced: ragged per-sample lists (rollout actors -> driver)
  `ScoredRollouts`  rollouts with one reward per sample (driver: buffer, dynamic sampling, advantages)
  `Sequences`       the same samples padded into tensors: what the reference and learners score
  `TrainBatch`      sequences with old log-probs, reference log-probs and advantages: what a learner trains on

Every sampled token carries the version of the weights that sampled it (`token_versions`): a batch may mix
versions (asynchronous mode), and so may one multi-turn episode, whose engine can switch weights between its turns.
A sample's `policy_version` is the oldest version among its trained tokens, and its staleness is `update version -
policy_version`: the staleness bound holds for every token it trains on.

A response is everything after the prompt: for a one-turn episode the sampled tokens, for a multi-turn one the
model's turns with the environment's observations (and the chat template's tokens around them) between them.
`loss_mask` says which tokens the model sampled (trained on) and which it was given (observations, masked).
Each type has `validate()`; `split(n)` / `concat(parts)` live with the type so that actor groups stay generic.
Shapes: B sequences, P padded prompt length (left-padded), T padded response length (right-padded).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from itertools import accumulate, pairwise
from typing import Any, TypeVar

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

    def row(self) -> dict[str, Any]:
        """The dataset row handed to reward functions and environments, with the answer under "answer" whatever
        `data.answer_key` is."""
        return self.sample if self.answer is None else {**self.sample, "answer": self.answer}


@dataclass(frozen=True)
class Episode:
    """How one sample's episode went (a one-turn episode for a reward-function job).

    turns            model turns taken
    tool_calls       tool calls the model made (parsed), and of them `tool_errors` whose tool failed
    parse_errors     turns whose tool-call markup could not be parsed (answered with an observation saying so)
    env_wait_s       seconds the episode waited on its environment (start and steps)
    engine_s         its share of the engine's time: each engine step's seconds divided among the requests it
                     advanced
    reward           the environment's reward (the sum of its steps' rewards); None when a reward function scores
                     the sample afterwards
    cut              why the episode ended before its environment said it was done ("max_turns", "max_tokens",
                     "context", "env_timeout", "env_error"), or None
    restarts         times the episode was started again because its environment's host died
    drift            tokens where the trajectory differs from what the engine was given and sampled (must be 0)
    template_drift   whether rendering the episode's messages through the chat template anew would give other
                     token ids than the trajectory (what a text-based assembly would train on instead)
    segment          which of its episode's sequences this row is (0: the first). An episode whose model calls do
                     not continue each other (an agent that starts a fresh conversation) is trained as several
                     sequences: contiguous rows of its group, segments 0, 1, 2, ... The segment-0 row carries the
                     episode's figures (turns ... template_drift); later segments carry zeros for them; every row
                     carries the episode's `reward`.
    """

    turns: int = 1
    tool_calls: int = 0
    tool_errors: int = 0
    parse_errors: int = 0
    env_wait_s: float = 0.0
    engine_s: float = 0.0
    reward: float | None = None
    cut: str | None = None
    restarts: int = 0
    drift: int = 0
    template_drift: bool = False
    segment: int = 0


@dataclass(frozen=True)
class Rollouts:
    """Samples from rollout actors: `n` episodes per prompt, grouped contiguously (prompt-major). An episode is one
row, or several contiguous rows (its segments, `Episode.segment`) when its model calls do not continue each other,
so a group has n episodes and at least n rows; "sample" below means a row.

    prompt_ids[i]        token ids of sample i's prompt (an episode's first prompt)
    response_ids[i]      token ids after the prompt, len L_i: the sampled tokens, and in a multi-turn episode the
                         observation tokens between its turns; exactly the ids the engine saw and sampled
    rollout_logprobs[i]  log-prob of each sampled token under the distribution sampled from, len L_i (0.0 on
                         observation tokens)
    loss_mask[i]         1 on tokens the model sampled, 0 on tokens it was given (observations), len L_i
    token_versions[i]    version of the weights that sampled each token, len L_i (observation tokens carry the
                         version of the turn before them)
    response_texts[i]    detokenized response
    finish_reasons[i]    "stop" (EOS or stop string) or "length" (of the last turn)
    group[i]             the prompt's ticket: its position in the stream of prompts the driver handed out (the
                         group id of group estimators, and what a checkpoint records as trained)
    policy_version[i]    the oldest version among sample i's trained tokens (what its staleness is counted from)
    episodes[i]          how sample i's episode went (`Episode`): turns, tool calls, the environment's reward
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    rollout_logprobs: list[list[float]]
    loss_mask: list[list[int]]
    token_versions: list[list[int]]
    response_texts: list[str]
    finish_reasons: list[str]
    group: list[int]
    policy_version: list[int]
    episodes: list[Episode]

    def __len__(self) -> int:
        return len(self.response_ids)

    def validate(self) -> Rollouts:
        n = len(self.response_ids)
        for f in fields(self):
            if len(getattr(self, f.name)) != n:
                raise ValueError(f"Rollouts.{f.name} has {len(getattr(self, f.name))} entries, response_ids has {n}")
        for i, ids in enumerate(self.response_ids):
            for name in ("rollout_logprobs", "loss_mask", "token_versions"):
                if len(getattr(self, name)[i]) != len(ids):
                    raise ValueError(f"Rollouts sample {i}: {len(ids)} response tokens but "
                                     f"{len(getattr(self, name)[i])} entries in {name}")
            trained = [v for v, m in zip(self.token_versions[i], self.loss_mask[i], strict=True) if m]
            if trained and min(trained) != self.policy_version[i]:
                raise ValueError(f"Rollouts sample {i}: policy_version {self.policy_version[i]} is not the oldest "
                                 f"version among its trained tokens ({min(trained)})")
            segment = self.episodes[i].segment
            if segment and not (i > 0 and self.group[i - 1] == self.group[i]
                                and self.episodes[i - 1].segment == segment - 1):
                raise ValueError(f"Rollouts sample {i}: segment {segment} of an episode does not follow its segment "
                                 f"{segment - 1} in the same group")
        return self

    def episode_bounds(self) -> list[tuple[int, int]]:
        """`(start, stop)` rows of each episode, in order: an episode starts at each segment-0 row."""
        starts = [i for i, e in enumerate(self.episodes) if e.segment == 0]
        return list(pairwise([*starts, len(self)]))

    def episode_index(self) -> list[int]:
        """The episode (0, 1, ... in row order) each row belongs to."""
        return [k for k, (a, b) in enumerate(self.episode_bounds()) for _ in range(a, b)]

    @staticmethod
    def empty() -> Rollouts:
        """No samples yet: filled with `add`."""
        return Rollouts(*([] for _ in fields(Rollouts)))

    def add(self, prompt_ids: list[int], response_ids: list[int], rollout_logprobs: list[float],
            loss_mask: list[int], token_versions: list[int], text: str, finish_reason: str, group: int,
            episode: Episode, version: int) -> None:
        """Append one sample (while it is being built by its producer); its policy version is the oldest among
        its trained tokens, or `version` (the engine's now) when it has none."""
        trained = [v for v, m in zip(token_versions, loss_mask, strict=True) if m]
        for name, value in (("prompt_ids", prompt_ids), ("response_ids", response_ids),
                            ("rollout_logprobs", rollout_logprobs), ("loss_mask", loss_mask),
                            ("token_versions", token_versions), ("response_texts", text),
                            ("finish_reasons", finish_reason), ("group", group),
                            ("policy_version", min(trained) if trained else version),
                            ("episodes", episode)):
            getattr(self, name).append(value)

    def select(self, rows: list[int]) -> Rollouts:
        """Samples `rows`, in that order."""
        return Rollouts(**{f.name: [getattr(self, f.name)[i] for i in rows] for f in fields(self)})

    @staticmethod
    def concat(parts: list[Rollouts]) -> Rollouts:
        """Join parts in order (they may come from different policy versions)."""
        if not parts:
            raise ValueError("Rollouts.concat needs at least one part")
        return Rollouts(**{f.name: [x for p in parts for x in getattr(p, f.name)] for f in fields(Rollouts)})


@dataclass(frozen=True)
class ScoredRollouts:
    """Rollouts and their rewards: `rewards[i]` scores sample i (0.0 where the reward function failed under
    `reward.on_error: zero`; the producer counts those as they are scored). Every row of an episode holds the
    episode's reward."""

    rollouts: Rollouts
    rewards: list[float]

    def __len__(self) -> int:
        return len(self.rollouts)

    def validate(self) -> ScoredRollouts:
        self.rollouts.validate()
        if len(self.rewards) != len(self.rollouts):
            raise ValueError(f"ScoredRollouts: {len(self.rewards)} rewards for {len(self.rollouts)} samples")
        for a, b in self.rollouts.episode_bounds():
            if any(r != self.rewards[a] for r in self.rewards[a:b]):
                raise ValueError(f"ScoredRollouts: the episode of samples {a}..{b - 1} has rewards "
                                 f"{self.rewards[a:b]}, not one reward on every row")
        return self

    def episode_rewards(self) -> list[float]:
        """One reward per episode (its first row's)."""
        return [self.rewards[a] for a, _ in self.rollouts.episode_bounds()]

    def groups(self) -> list[ScoredRollouts]:
        """One part per prompt (its contiguous samples)."""
        starts = [i for i, g in enumerate(self.rollouts.group) if i == 0 or g != self.rollouts.group[i - 1]]
        bounds = [*starts, len(self)]
        return [ScoredRollouts(self.rollouts.select(list(range(a, b))), self.rewards[a:b])
                for a, b in pairwise(bounds)]

    @staticmethod
    def concat(parts: list[ScoredRollouts]) -> ScoredRollouts:
        return ScoredRollouts(Rollouts.concat([p.rollouts for p in parts]), [r for p in parts for r in p.rewards])


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


def _split_rows(batch: R, n: int) -> list[R]:
    """n contiguous shards whose sizes differ by at most one (equal when n divides B)."""
    size = batch.batch_size
    if n <= 0 or n > size:
        raise ValueError(f"{type(batch).__name__}.split: cannot split a batch of {size} into {n} non-empty shards")
    bounds = [round(i * size / n) for i in range(n + 1)]
    return [batch.select(slice(a, b)) for a, b in pairwise(bounds)]


def _chunk_rows(batch: R, size: int) -> list[R]:
    return [batch.select(slice(i, i + size)) for i in range(0, batch.batch_size, size)]


@dataclass(frozen=True)
class Sequences:
    """Padded samples, as the reference and learners score them.

    input_ids         [B, P+T] long   prompt left-padded to P, then response right-padded to T
    attention_mask    [B, P+T] long   1 on real tokens
    response_mask     [B, T]   float  1 on response tokens that count in the loss
    rollout_logprobs  [B, T]   float  the sampler's log-probs of the sampled tokens (0 on padding and observations)
    policy_version    [B]      long   the oldest version of the weights among each sample's trained tokens
    response_versions [B, T]   long   version of the weights that sampled each response token (0 on padding)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    policy_version: torch.Tensor
    response_versions: torch.Tensor

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
        """Stack shards along B; shards must share P and T."""
        if not parts:
            raise ValueError("Sequences.concat needs at least one part")
        return Sequences(**{f.name: torch.cat([getattr(p, f.name) for p in parts]) for f in fields(Sequences)})


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
    """

    sequences: Sequences
    old_logprobs: torch.Tensor | None
    advantages: torch.Tensor
    ref_logprobs: torch.Tensor | None
    old_values: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    mini_batch: torch.Tensor | None = None

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
        for name in ("old_logprobs", "advantages", "ref_logprobs", "old_values", "returns"):
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

    def shard(self, n: int, mini_batches: int) -> list[TrainBatch]:
        """n data-parallel shards of `mini_batches` mini-batches (the config's optimizer steps per pass). The B rows
        are cut into `mini_batches` contiguous mini-batches whose sizes differ by at most one, each into n
        contiguous parts likewise; shard k holds the k-th part of every mini-batch, its rows labelled with their
        mini-batch (`mini_batch`), so every learner takes the same optimizer steps, each on its part of the same
        global mini-batch, and M learners take exactly the steps one learner would (the loss divides by counts
        all-reduced over the learners, so unequal parts weigh their rows as one learner would). A batch whose rows
        divide evenly gives every learner `B / mini_batches / n` rows of each."""
        if mini_batches <= 0 or n <= 0 or self.batch_size < mini_batches * n:
            raise ValueError(f"TrainBatch.shard: a batch of {self.batch_size} rows does not make {mini_batches} "
                             f"mini-batches of at least one row for each of {n} learners")
        parts = [replace(mini, mini_batch=torch.full((mini.batch_size,), j, dtype=torch.long)).split(n)
                 for j, mini in enumerate(_split_rows(self, mini_batches))]
        return [TrainBatch.concat([p[k] for p in parts]) for k in range(n)]

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
        or none has."""
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
        )
