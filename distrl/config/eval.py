"""`eval`: held-out sets the run evaluates on the rollout engines during training (and `distrl eval` without it)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from distrl.config.base import Section
from distrl.config.model import DataConfig


class EvalSamplingConfig(Section):
    """How held-out answers are sampled; `top_k` and stop strings are the rollout's (`rollout.sampling`)."""

    n: int = Field(default=1, gt=0)
    """Samples per prompt: pass@k is reported for every k up to n."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0: greedy decoding; above: sampling at that temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    max_new_tokens: int | None = Field(default=None, gt=0)
    """Tokens per turn; null: `rollout.sampling.max_new_tokens`."""

    @model_validator(mode="after")
    def _greedy_is_one(self) -> EvalSamplingConfig:
        if self.temperature == 0.0 and self.n > 1:
            raise ValueError(f"eval.sampling.n = {self.n} greedy samples (temperature 0) would all be the same: "
                             f"set eval.sampling.temperature above 0, or n to 1")
        return self


class EvalSetConfig(DataConfig):
    """A held-out set: the same dataset spec as `data`, with a name, an optional limit and reward."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    """The set's name in the figures: `eval/<name>/...`."""
    limit: int | None = Field(default=None, gt=0)
    """Evaluate only the first `limit` prompts of the set (in file order); null: all of them."""
    reward: str | None = None
    """Reward function of this set, `package.module:function`; null: `reward.function` (with an `env` section, the
    environment's reward)."""
    shuffle: Literal[False] = False
    """A held-out set is evaluated in its own order (`limit` takes its first prompts): never shuffled."""


class EvalConfig(Section):
    sets: list[EvalSetConfig] = Field(min_length=1)
    """The held-out sets."""
    every: int | None = Field(default=None, gt=0)
    """Evaluate after every `every` steps (on the weights of that step); null: only at the end."""
    at_end: bool = True
    """Evaluate after the last step too."""
    sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    """How answers are sampled: greedy, or `n` samples at a temperature."""
    pass_threshold: float = 1.0
    """A sample is correct (pass@k, maj@k) when its reward is at least this."""

    @model_validator(mode="after")
    def _distinct_names(self) -> EvalConfig:
        names = [s.name for s in self.sets]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"eval.sets: names must differ, {repeated} appear more than once")
        return self

    def due(self, step: int, last: int) -> bool:
        """Whether the weights of `step` are evaluated, in a run whose last step is `last`."""
        return bool(self.every and step % self.every == 0) or (self.at_end and step == last)
