"""`import_spec`: the object a config names as `package.module:attribute` (a reward function, an environment class,
a tool), with errors that say which part is wrong. Below every room: rewards, environments and tools share it."""

from __future__ import annotations

import importlib
from typing import Any


def import_spec(spec: str, what: str, form: str, example: str) -> Any:
    """The attribute `spec` names. For the errors (each a ValueError naming the spec and the part that failed):
    `what` it is ("reward function", "environment"), the `form` its attribute takes ("function", "Class") and
    `example`, a valid spec."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"{what} {spec!r} must be written 'package.module:{form}', e.g. '{example}'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {err}") from err
    found = getattr(module, attr, None)
    if found is None:
        raise ValueError(f"{what} {spec!r}: module {module_name!r} has no attribute {attr!r}")
    return found
