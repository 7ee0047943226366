"""Tools a model calls during an episode: the `Tool` protocol, its `ToolResult`, the built-ins and their registry."""

from distrl.agents.tools.base import TOOLS, Tool, ToolResult, resolve_tool, truncate

__all__ = ["TOOLS", "Tool", "ToolResult", "resolve_tool", "truncate"]
