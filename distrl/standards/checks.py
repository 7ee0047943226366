"""What the adapters can tell of a config before a run starts, for the preflight: a verifiers environment that
offers tools needs a tool parser; a held-out set must not draw the training data's reasoning-gym rows. Imports the
adapters (not their packages, which each imports only when used)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from distrl.standards import reasoning_gym, verifiers


def env_problems(spec: str | None, kwargs: dict[str, Any], tool_parser: str | None) -> list[str]:
    """What an adapter can tell of the environment `spec` (`env.class`, with `env.kwargs`) names before a run
    starts, one line per problem naming its field: a verifiers environment that offers tools needs
    `env.tool_parser`; a mixture's environments are checked each. Other environments: nothing."""
    if spec == "distrl.standards.verifiers:VerifiersEnv":
        return verifiers.problems(kwargs, tool_parser)
    if spec == "distrl.standards.mixture:Mixture":
        parts = kwargs.get("envs") or {}
        return [line for part in parts.values() if isinstance(part, dict)
                for line in env_problems(part.get("class"), part.get("kwargs") or {}, tool_parser)]
    return []


def held_out_problems(data: dict[str, Any], eval_sets: list[dict[str, Any]]) -> list[str]:
    """One line per held-out set (each a dict of `eval.sets`) drawing reasoning-gym rows that the training data
    (`data`, as a dict) draws too (`distrl.standards.reasoning_gym.held_out_problems`), wherever either names
    reasoning-gym's rows: as its function, or as a source of a mixture's rows."""
    training = list(_generators(data, "data"))
    return [line for i, held in enumerate(eval_sets)
            for kwargs, field in _generators(held, f"eval.sets[{i}] ({held.get('name')})")
            for train_kwargs, train_field in training
            for line in reasoning_gym.held_out_problems(train_kwargs, kwargs, field, train_field)]


def _generators(source: dict[str, Any], field: str) -> Iterator[tuple[dict[str, Any], str]]:
    """(kwargs, config path) of each reasoning-gym `rows` call that data `source` ({function, kwargs}) makes."""
    function, kwargs = source.get("function"), source.get("kwargs") or {}
    if function == "distrl.standards.reasoning_gym:rows":
        yield kwargs, field
    elif function == "distrl.standards.mixture:rows":
        for name, part in (kwargs.get("sources") or {}).items():
            if isinstance(part, dict):
                yield from _generators(part, f"{field}.kwargs.sources.{name}")
