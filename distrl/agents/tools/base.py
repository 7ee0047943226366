"""The tool contract: a `Tool` takes the model's JSON arguments and returns a bounded `ToolResult`.

A tool never raises for the model's mistakes (bad arguments, errors in code it ran, time-outs): those come back as a
`ToolResult` whose `error` names the kind, so the episode shows the model what went wrong and goes on. It raises only
for the programmer's mistakes (a wrong spec or constructor keyword in config) and for a broken host (no sandbox).
Config names a tool as a built-in name from `TOOLS` or as `package.module:Class`; `resolve_tool` builds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from distrl.imports import import_spec

__all__ = ["DEFAULT_MAX_OUTPUT_CHARS", "TOOLS", "Tool", "ToolResult", "resolve_tool", "truncate"]

DEFAULT_MAX_OUTPUT_CHARS = 2000
"""Characters of a tool's content that reach the model; the rest is cut and the cut is said (see `truncate`)."""


@dataclass(frozen=True)
class ToolResult:
    """What a tool call returns to the model as the tool message's content, and, if it failed, why."""

    content: str
    error: str | None = None  # None on success; else a short kind: "bad_arguments", "timeout", "runtime_error", ...


@runtime_checkable
class Tool(Protocol):
    """A function the model may call: `name` is what it calls, `schema()` how it is described to the model."""

    name: str

    def schema(self) -> dict:
        """OpenAI/transformers function schema: {"type": "function", "function": {"name", "description",
        "parameters": JSON schema}}."""
        ...

    async def call(self, arguments: dict) -> ToolResult:
        """Run the tool on the model's arguments; the model's mistakes are results with `error` set, never raised."""
        ...


def truncate(text: str, max_chars: int) -> tuple[str, bool]:
    """(`text` cut to its first `max_chars` characters plus a note saying how much was cut, whether it was cut)."""
    if len(text) <= max_chars:
        return text, False
    return f"{text[:max_chars]}\n[truncated: showing the first {max_chars} of {len(text)} characters]", True


TOOLS: dict[str, str] = {
    "calculator": "distrl.agents.tools.calculator:Calculator",
    "python": "distrl.agents.tools.python:PythonTool",
}
"""Built-in tools by name. Values are `module:Class` specs, imported on use, so naming one tool in config does not
import (or probe the sandbox of) another."""


def resolve_tool(spec: str, kwargs: dict | None = None) -> Tool:
    """The tool `spec` names (a key of `TOOLS`, or `package.module:Class`), constructed with `kwargs`."""
    path = TOOLS.get(spec, spec)
    if ":" not in path:
        raise ValueError(f"tool {spec!r} must be a built-in ({', '.join(sorted(TOOLS))}) or written "
                         f"'package.module:Class', e.g. 'distrl.agents.tools.calculator:Calculator'")
    cls = import_spec(path, "tool", "Class", "distrl.agents.tools.calculator:Calculator")
    if not callable(cls):
        raise ValueError(f"tool {spec!r} is a {type(cls).__name__}, not a class")
    try:
        tool = cls(**(kwargs or {}))
    except TypeError as err:
        raise ValueError(f"tool {spec!r}: cannot construct {path} with arguments {sorted(kwargs or {})}: "
                         f"{err}") from err
    if not isinstance(tool, Tool):
        raise ValueError(f"tool {spec!r}: {path} built a {type(tool).__name__}, which lacks the Tool protocol's "
                         f"`name`, `schema()` and `call()`")
    return tool
