"""Environments written for other standards, run by distrl as they are: adapters from verifiers, OpenEnv,
reasoning-gym, skyrl-gym and gem to distrl's environment protocol (`distrl.agents.env`) and data sources.

Each adapter is a module here, named in a config like any environment class, data function or reward function
(`env.class: distrl.standards.verifiers:VerifiersEnv`, `data.function: distrl.standards.reasoning_gym:rows`). Its
package is an optional extra (`pip install 'distrl[verifiers]'`), imported only when an episode, a row or a score
needs it: the preflight names the extra a config needs and is missing (`missing`), and what each adapter can tell of
its config (`distrl.standards.checks`), before any actor starts.

`seeds` makes the rows of environments that make their own prompts (OpenEnv servers, Gym-style games): one row per
episode, its seed; `numeric` makes an environment's own figures (an info dict, an observation's metadata) into an
episode's `Step.metrics`. `distrl.standards.mixture` trains on several environments in one run.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
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
