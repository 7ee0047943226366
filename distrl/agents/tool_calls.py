"""Tool calls parsed from a model's turn by vLLM's maintained parsers (Hermes, Qwen, Llama, Mistral, ...), chosen by
name (`env.tool_parser`).

A turn whose markup looks like a tool call but does not parse (bad JSON, no name) is not a crash: it becomes a
`Turn` with `parse_error` set, which the environment answers ("could not parse ...") and the step counts. vLLM's
parsers answer such text with "no call" and the raw text as content; the parser's own start token in the text
tells a malformed call from plain prose.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

from distrl.agents.env import ToolCall

PARSER_LOGGER = "vllm.tool_parsers"


class ToolCallParser:
    """Parses turns with vLLM's tool parser `name` for `tokenizer`."""

    def __init__(self, name: str, tokenizer: Any):
        from vllm.tool_parsers import ToolParserManager

        try:
            cls = ToolParserManager.get_tool_parser(name)
        except KeyError as err:
            raise ValueError(f"env.tool_parser {name!r} is not one of vLLM's tool parsers: "
                             f"{', '.join(sorted(ToolParserManager.list_registered()))}") from err
        self.name, self.parser = name, cls(tokenizer)
        self.marker: str | None = getattr(self.parser, "tool_call_start_token", None)
        # A malformed call is an observation here; vLLM's parsers also log it with a traceback at ERROR.
        logging.getLogger(PARSER_LOGGER).setLevel(logging.CRITICAL)

    def parse(self, text: str) -> tuple[str, list[ToolCall], str | None]:
        """(content outside the calls, the calls, why the markup did not parse or None)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        info = self.parser.extract_tool_calls(text, ChatCompletionRequest(model="distrl", messages=[]))
        if not info.tools_called:
            if self.marker and self.marker in text:
                return text, [], f"could not parse the tool call in {_excerpt(text)} ({self.name} format)"
            return info.content if info.content is not None else text, [], None
        calls = []
        for i, call in enumerate(info.tool_calls):
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as err:
                return text, [], f"the arguments of tool call {call.function.name!r} are not JSON: {err}"
            if not isinstance(arguments, dict):
                return text, [], f"the arguments of tool call {call.function.name!r} are not a JSON object"
            calls.append(ToolCall(call.function.name, arguments, call.id or f"call_{i}"))
        return info.content or "", calls, None


def known_tool_parsers() -> set[str] | None:
    """The names of vLLM's tool parsers, read from the registry's source without importing vLLM (seconds, which the
    preflight would spend on every `distrl validate`); None when vLLM is not installed or keeps them elsewhere (the
    rollout worker still checks the name when it builds the parser)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "tool_parsers" / "__init__.py"
    try:
        tree = ast.parse(source.read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_TOOL_PARSERS_TO_REGISTER" for t in node.targets)):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return None


def _excerpt(text: str, limit: int = 120) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")
