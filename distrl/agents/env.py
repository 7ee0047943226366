"""The environment protocol: what a user implements to train a model on multi-turn, tool-using episodes.

One instance per episode, built as `Class(**env.kwargs)` from the config's `env.class: package.module:Class`:

    class Environment(Protocol):
        async def start(self, row: dict) -> Start   # the dataset row -> first messages and the tools offered
        async def step(self, turn: Turn) -> Step    # the model's turn -> observation, reward, done

Both methods are coroutines, so an environment may wait on I/O (a sandbox, a remote service) while the engine
generates for other episodes. The model's turn arrives decoded and with its tool calls parsed by the model's own
tool-call format (`env.tool_parser`); the environment answers with chat messages (`{"role": "tool", "content":
...}` for tool results, `{"role": "user", ...}` for its own words), which distrl renders through the chat template
and appends to the trajectory as tokens the model is given, not trained on. The episode's reward is the sum of its
steps' rewards (None counts as 0): an outcome reward is the last step's. An environment that holds something
beyond the episode (a connection, a server session, a task) may also have `def close(self) -> None`, called once
when the episode ends, however it ends; it must not raise.

Smaller than SkyRL-gym's `BaseTextEnv` (no string observations to re-tokenize, no per-env max-turn logic: the
budgets are distrl's), verl's `AgentLoopBase` (distrl owns the generation loop) and verifiers' environments (no
rubric classes): two coroutines and four small types. Environments written for those standards run through
the adapters of `distrl.standards`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from distrl.imports import import_spec


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from the model's turn: the function's name and its arguments (decoded JSON)."""

    name: str
    arguments: dict[str, Any]
    id: str = ""


@dataclass(frozen=True)
class Start:
    """How an episode begins. `messages`: the first chat messages (system, user); None takes the dataset row's
    prompt (`data.prompt_key`) as the data section renders it. `tools`: JSON schemas of the functions the model may
    call (`{"type": "function", "function": {"name", "description", "parameters"}}`), given to the chat template."""

    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Turn:
    """The model's turn. `text`: all of it, decoded (tool-call markup included); `content`: the text outside tool
    calls; `tool_calls`: the calls parsed from it; `parse_error`: why markup that looks like a tool call could not
    be parsed (then `tool_calls` is empty), else None; `index`: 0 for the first turn; `finish_reason`: "stop"
    (the model ended its turn) or "length" (cut at `rollout.sampling.max_new_tokens`)."""

    text: str
    content: str
    tool_calls: list[ToolCall]
    parse_error: str | None
    index: int
    finish_reason: str = "stop"

    def as_message(self) -> dict[str, Any]:
        """The turn as the assistant message of a chat history (transformers' tool-call layout)."""
        message: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [{"type": "function", "id": c.id,
                                      "function": {"name": c.name, "arguments": c.arguments}}
                                     for c in self.tool_calls]
        return message


@dataclass(frozen=True)
class Step:
    """The environment's answer to a turn: the observation `messages` appended after it (ignored when `done`), a
    `reward` (None: no reward this step), `done` (the episode is over), how many of the turn's tool calls failed
    (`tool_errors`, for the step's `agent/tool_errors` figure), and figures on the episode by name (`metrics`:
    the components of a rubric, a Gym environment's info; a later step's value of a name replaces an earlier
    one), logged per training step as `env/<name>`."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    done: bool = False
    tool_errors: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    async def start(self, row: dict[str, Any]) -> Start: ...

    async def step(self, turn: Turn) -> Step: ...


def resolve_env(spec: str) -> type:
    """The environment class that `spec` (`package.module:Class`) names, checked for the two coroutines."""
    cls = import_spec(spec, "environment", "Class", "distrl.agents.envs:ToolEnvironment")
    if not inspect.isclass(cls):
        raise ValueError(f"environment {spec!r} is a {type(cls).__name__}, not a class")
    for method in ("start", "step"):
        if not inspect.iscoroutinefunction(getattr(cls, method, None)):
            raise ValueError(f"environment {spec!r}: {method} must be an 'async def' method "
                             f"(see distrl.agents.env.Environment)")
    return cls
