"""`env`: the environment of multi-turn episodes, or the agent function that plays them (absent: one-turn episodes
scored by `reward.function`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from distrl.config.base import Section


class EnvConfig(Section):
    model_config = ConfigDict(populate_by_name=True)

    cls: str | None = Field(default=None, alias="class", min_length=1)
    """The environment class, `package.module:Class` (see `distrl.agents.env.Environment`), e.g.
    `distrl.agents.envs:ToolEnvironment`. One instance per episode, built with `kwargs`."""
    agent: str | None = Field(default=None, min_length=1)
    """Or an agent function, `package.module:function` (see `distrl.agents.agent`): `async def agent(client, row,
    **kwargs) -> float` plays an episode against an OpenAI-compatible client that the rollout worker serves."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the class (or of the agent function, after the client and the row)."""
    max_turns: int = Field(default=8, gt=0)
    """Model turns per episode (an agent's calls); an episode still going after them ends, recorded as cut by
    `max_turns` (an agent's next call is refused)."""
    max_tokens: int | None = Field(default=None, gt=0)
    """Response tokens per episode (per sequence of an agent's episode), the model's turns and the observations
    between them; null means the engine's context less the prompt. Each turn samples at most
    `rollout.sampling.max_new_tokens` of them."""
    agent_timeout_s: float = Field(default=600.0, gt=0.0)
    """An agent function that has not returned after this long ends its episode, recorded as cut by
    `env_timeout` (reward 0)."""
    step_timeout_s: float = Field(default=60.0, gt=0.0)
    """An environment's start or step that takes longer ends its episode, recorded as cut by `env_timeout`."""
    on_error: Literal["raise", "zero"] = "raise"
    """An environment that raises ends the run naming the class, the episode and the failing line (`raise`), or
    ends its episode with reward 0, counted in `agent/env_errors` (`zero`)."""
    tool_parser: str | None = "hermes"
    """vLLM's tool-call parser for the model's chat format (`hermes` for Qwen2.5 and Hermes models, `llama3_json`,
    `mistral`, ...); null: turns are passed on as text, with no tool calls parsed."""

    @model_validator(mode="after")
    def _one_kind(self) -> EnvConfig:
        if (self.cls is None) == (self.agent is None):
            raise ValueError("give exactly one of env.class (an environment class) and env.agent (an agent "
                             "function)")
        return self
