"""The pieces an episode is made of, shared by the two ways of running one (`distrl.agents.episode`: an
environment's turns; `distrl.agents.calls`: an agent function's calls): a turn as the engine sampled it (`Sampled`)
and what samples it (`TurnSampler`), the episode's limits (`Budget`), its token-exact ids as they grow
(`Trajectory`), the seed of each of its turns, and the finished result (`EpisodeResult`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from distrl.config import EnvConfig
from distrl.types.rollouts import Episode


@dataclass(frozen=True)
class Sampled:
    """One turn as the engine produced it: the prompt ids it echoed, the sampled ids with their log-probs and the
    policy version of the weights that sampled each, the decoded text, why it stopped ("stop" or "length"), its
    share of the engine's time, and with `rollout.routing_replay` the experts every token it fed through the model
    was routed to (`routes` `[n, L, k]`, numpy: the prompt's tokens and the sampled ones but the last, as vLLM
    returns them; else None)."""

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    text: str
    finish_reason: str
    engine_s: float = 0.0
    routes: Any = None


class TurnSampler(Protocol):
    @property
    def version(self) -> int:
        """The policy version the engine serves now."""

    async def sample(self, prompt_ids: list[int], max_tokens: int, seed: int) -> Sampled: ...


@dataclass(frozen=True)
class Budget:
    """An episode's limits: model turns, response tokens (turns and observations), the engine's context, and the
    tokens of one turn."""

    max_turns: int
    max_tokens: int
    context: int
    max_new_tokens: int

    @staticmethod
    def of(max_new_tokens: int, env: EnvConfig | None, context: int) -> Budget:
        """The budget of an engine whose context is `context` tokens: one turn of `max_new_tokens` without an
        environment; with one, `env.max_turns` such turns within `env.max_tokens` (null: the context)."""
        if env is None:
            return Budget(1, max_new_tokens, context, max_new_tokens)
        return Budget(env.max_turns, env.max_tokens or context, context, max_new_tokens)


@dataclass
class Trajectory:
    """The episode's ids as they grow: the prompt, then model turns (trained) and observations (given); `routes`:
    the experts its first tokens were routed to (`Rollouts.routes`), or None."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routes: Any = None

    @property
    def ids(self) -> list[int]:
        return [*self.prompt_ids, *self.response_ids]

    def add_turn(self, turn: Sampled) -> None:
        # A turn given the whole trajectory returns the routes of all of it (every earlier turn's and observation's
        # tokens, as the engine routed them: a cached prefix keeps the routes it was computed with) and of its own
        # tokens but the last: they replace the shorter ones of the turns before. A turn that was given other ids
        # (drift) has routes of other tokens, and the earlier ones stay.
        if turn.routes is not None and turn.prompt_ids == self.ids:
            self.routes = turn.routes
        self.response_ids += turn.token_ids
        self.logprobs += turn.logprobs
        self.mask += [1] * len(turn.token_ids)
        self.versions += turn.versions

    def add_observation(self, ids: list[int], version: int) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [version] * len(ids)


def drift(echoed: list[int], expected: list[int]) -> int:
    """Positions where the prompt the engine echoed differs from the trajectory it was given (length included)."""
    return sum(a != b for a, b in zip(echoed, expected, strict=False)) + abs(len(echoed) - len(expected))


# Turn t's seed is t strides above the first turn's. The stride is odd and below 2**32 so that the low 32 bits
# differ: a CPU torch generator (vLLM's on CPU, transformers' sampler) is seeded from those bits only, and a stride
# of 2**32 gave every turn of a sample the first turn's random stream again (issue 37: a partial rollout that
# outlived its first slice replayed its draws slice after slice and never ended). It is 2**32 over the golden ratio,
# whose multiples stay far apart modulo 2**32: turn t of sample j never meets turn t' of sample j' of the same
# prompt for the thousands of turns and samples a run has.
TURN_STRIDE = 0x9E3779B9


def turn_seed(base: int, sample: int, turn: int) -> int:
    """Seed of turn `turn` of sample `sample` of a prompt whose request seed is `base`: the first turn's is vLLM's
    own for the j-th of n samples (base + j), so a one-turn episode samples what `n`-sample generation does; each
    later turn's is `TURN_STRIDE` further (below 2**63, vLLM's bound, for base below 2**56 and any run's turns)."""
    return base + sample + turn * TURN_STRIDE


@dataclass
class EpisodeResult:
    """One finished episode: its trajectory, the text of its response, the last turn's finish reason, and its
    `Episode` record."""

    trajectory: Trajectory
    text: str
    finish_reason: str
    episode: Episode
