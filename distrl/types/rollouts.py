"""What engines produce and rewards score, one entry a sample, in ragged per-sample lists: `Rollouts` (with each
sample's `Episode`) and `ScoredRollouts`. Plain Python (no torch; a sample's routes are the numpy array vLLM returns):
they cross from rollout actors to the driver.

Every sampled token carries the version of the weights that sampled it (`token_versions`): a batch may mix
versions (asynchronous mode), and so may one multi-turn episode, whose engine can switch weights between its turns.
A sample's `policy_version` is the oldest version among its trained tokens, and its staleness is `update version -
policy_version`: the staleness bound holds for every token it trains on.

A response is everything after the prompt: for a one-turn episode the sampled tokens, for a multi-turn one the
model's turns with the environment's observations (and the chat template's tokens around them) between them.
`loss_mask` says which tokens the model sampled (trained on) and which it was given (observations, masked).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from itertools import pairwise
from typing import Any

PARTIAL = "partial"
"""The finish reason of a sample not finished yet (`loop.partial_rollouts`): it is carried over and continued."""


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
    metrics          figures the environment reported on the episode by name (a verifiers rubric's components, a
                     Gym environment's info), logged per step as `env/<name>` (their mean over the episodes that
                     report each)
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
    metrics: dict[str, float] = field(default_factory=dict)


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
    finish_reasons[i]    "stop" (EOS or stop string) or "length" (of the last turn); `PARTIAL` for a sample not
                         finished yet (partial rollouts: it is continued later, never trained as it is)
    group[i]             the prompt's ticket: its position in the stream of prompts the driver handed out (the
                         group id of group estimators, and what a checkpoint records as trained)
    policy_version[i]    the oldest version among sample i's trained tokens (what its staleness is counted from)
    episodes[i]          how sample i's episode went (`Episode`): turns, tool calls, the environment's reward
    routes[i]            rollout routing replay (`rollout.routing_replay`): the experts the engine routed each of
                         the first n_i tokens of prompt + response to, a numpy array `[n_i, L, k]` (L MoE layers, k
                         experts per token; uint8 for up to 256 experts, else uint16: vLLM's own), n_i at most the
                         sample's prompt and response length (the last token is never fed to the engine, and an
                         episode's trailing observation is not either); None without routes
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
    routes: list[Any]

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
            routed = self.routes[i]
            if routed is not None and (routed.ndim != 3 or len(routed) > len(self.prompt_ids[i]) + len(ids)):
                raise ValueError(f"Rollouts sample {i}: routes of shape {tuple(routed.shape)} for "
                                 f"{len(self.prompt_ids[i]) + len(ids)} tokens (expected [n <= tokens, layers, k])")
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
            episode: Episode, version: int, routes: Any = None) -> None:
        """Append one sample (while it is being built by its producer); its policy version is the oldest among
        its trained tokens, or `version` (the engine's now) when it has none. `routes`: its tokens' experts, or
        None."""
        trained = [v for v, m in zip(token_versions, loss_mask, strict=True) if m]
        for name, value in (("prompt_ids", prompt_ids), ("response_ids", response_ids),
                            ("rollout_logprobs", rollout_logprobs), ("loss_mask", loss_mask),
                            ("token_versions", token_versions), ("response_texts", text),
                            ("finish_reasons", finish_reason), ("group", group),
                            ("policy_version", min(trained) if trained else version),
                            ("episodes", episode), ("routes", routes)):
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
