"""Importing this module imports verifiers with the `agents` package it needs (openai-agents). Under pytest,
`tests/` is on sys.path (its test modules import each other by name), where `tests/agents` is a package named
`agents` too, which would shadow openai-agents for verifiers' `from agents.function_schema import ...`. The
shadowing exists only in the test process (a user's, and every Ray actor, import the real package).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def _import_verifiers_beside_tests_agents() -> None:
    tests = Path(__file__).resolve().parents[1]
    shadow = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "agents" or k.startswith("agents.")}
    path = list(sys.path)
    sys.path[:] = [p for p in path if Path(p or ".").resolve() != tests]
    try:
        import verifiers.utils.tool_utils  # noqa: F401 - binds openai-agents' function_schema
    finally:
        sys.path[:] = path
        for k in [k for k in sys.modules if k == "agents" or k.startswith("agents.")]:
            del sys.modules[k]
        sys.modules.update(shadow)


if importlib.util.find_spec("verifiers") is not None:
    _import_verifiers_beside_tests_agents()
