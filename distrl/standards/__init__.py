"""Environments written for other standards, run by distrl as they are: adapters from verifiers, OpenEnv,
reasoning-gym, skyrl-gym and gem to distrl's environment protocol (`distrl.agents.env`) and data sources.

Each adapter is a module here, named in a config like any environment class, data function or reward function
(`env.class: distrl.standards.verifiers:VerifiersEnv`, `data.function: distrl.standards.reasoning_gym:rows`). Its
package is an optional extra (`pip install 'distrl[verifiers]'`), imported only when an episode, a row or a score
needs it: the preflight names the extra a config needs and is missing (`missing`), before any actor starts.

`seeds` makes the rows of environments that make their own prompts (OpenEnv servers, Gym-style games): one row per
episode, its seed; `numeric` makes an environment's own figures (an info dict, an observation's metadata) into an
episode's `Step.metrics`. `distrl.standards.mixture` trains on several environments in one run.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Standard:
    """An adapter's package: what it is imported as, and the extra of distrl that installs it."""

    package: str
    extra: str

    @property
    def pip(self) -> str:
        return f"pip install 'distrl[{self.extra}]'"


STANDARDS = {
    "verifiers": Standard("verifiers", "verifiers"),
    "openenv": Standard("openenv", "openenv"),
    "reasoning_gym": Standard("reasoning_gym", "reasoning-gym"),
    "skyrl_gym": Standard("skyrl_gym", "skyrl-gym"),
    "gem": Standard("gem", "gem"),
}
"""Adapter module (`distrl.standards.<name>`) -> its package and extra."""

_SPEC = re.compile(r"^distrl\.standards\.(\w+)(?:[.:]|$)")


class StandardMissing(ImportError):
    """An adapter's package is not installed; the message is the `pip install` line that installs it."""


def require(name: str) -> ModuleType:
    """The package of adapter `name` (a key of STANDARDS), imported; StandardMissing with the pip line if absent."""
    standard = STANDARDS[name]
    if importlib.util.find_spec(standard.package) is None:
        raise StandardMissing(f"distrl.standards.{name} needs the {standard.package} package, which is not "
                              f"installed: {standard.pip}")
    return importlib.import_module(standard.package)


def missing(value: Any, field: str) -> list[str]:
    """One line per adapter that `value` (a config section as plain data: strings, lists, dicts) names and whose
    package is not installed, each starting with `field` (the config path where it was found) and ending with the
    pip line. Adapters are found wherever a string names one, e.g. inside a mixture's kwargs."""
    if isinstance(value, str):
        found = _SPEC.match(value)
        standard = STANDARDS.get(found.group(1)) if found else None
        if standard is None or importlib.util.find_spec(standard.package) is not None:
            return []
        return [f"{field}: {value} needs the {standard.package} package, which is not installed: {standard.pip}"]
    if isinstance(value, dict):
        return [line for k, v in value.items() for line in missing(v, f"{field}.{k}")]
    if isinstance(value, list):
        return [line for i, v in enumerate(value) for line in missing(v, f"{field}[{i}]")]
    return []


def env_problems(spec: str | None, kwargs: dict[str, Any], tool_parser: str | None) -> list[str]:
    """What an adapter can tell of the environment `spec` (`env.class`, with `env.kwargs`) names before a run
    starts, one line per problem naming its field: a verifiers environment that offers tools needs
    `env.tool_parser`; a mixture's environments are checked each. Other environments: nothing."""
    if spec == "distrl.standards.verifiers:VerifiersEnv":
        from distrl.standards import verifiers

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
    from distrl.standards import reasoning_gym

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


def seeds(count: int, first: int = 0) -> list[dict[str, Any]]:
    """`count` rows `{"prompt": "episode <seed>", "seed": seed}` for seeds first, first + 1, ...: the data of
    environments that make their own first messages (an OpenEnv server's `reset`, a Gym game's), where a row says
    only which episode to play. The prompt is the row's label, never shown to the model."""
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    return [{"prompt": f"episode {seed}", "seed": seed} for seed in range(first, first + count)]


def numeric(values: dict[str, Any]) -> dict[str, float]:
    """The numbers among `values` (a Gym step's info, an observation's metadata, an environment's metrics), as
    figures; booleans and everything else are left out."""
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float) and not isinstance(v, bool)}
