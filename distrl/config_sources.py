"""Where a raw config came from, for errors that point at it: YAML key lines, `--set` overrides, and Pydantic
errors rendered as `field.path: message  (file:line)`. Works on raw mappings; knows nothing of the schema.

Imports only Pydantic and PyYAML, like `distrl.config`.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    """A config could not be loaded; the message lists every problem with its field path and where it was set."""


Origins = dict[tuple[str, ...], str]
"""Where each key of the raw tree was written: `file:line` or `--set key=value`."""


def yaml_origins(text: str, source: str) -> Origins:
    """Map every key path of a YAML document to `source:line` (1-based), so errors can point at the line."""
    origins: Origins = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                child = (*path, str(key.value))
                origins[child] = f"{source}:{key.start_mark.line + 1}"
                walk(value, child)

    root = yaml.compose(text)
    if root is not None:
        walk(root, ())
    return origins


def _parse_value(text: str) -> Any:
    """Parse an override's right-hand side as YAML (`0.1`, `true`, `null`, `[a, b]`); empty means ''."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def apply_override(tree: dict[str, Any], override: str, origins: Origins | None = None) -> None:
    """Apply one `dotted.key=value` override to a raw (not yet validated) config mapping, in place."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: expected key=value, e.g. --set loss.kl.coef=0.01")
    parts = tuple(key.strip().split("."))
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--set {override!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = _parse_value(value)
    if origins is not None:
        origins[parts] = f"--set {override}"


def _where(loc: tuple[str, ...], origins: Origins) -> str | None:
    """The origin of the longest prefix of `loc` that was written somewhere."""
    for n in range(len(loc), 0, -1):
        if loc[:n] in origins:
            return origins[loc[:n]]
    return None


_FIELD_PATH = re.compile(r"\b[a-z_]+(?:\.[a-z_]+)+\b")


def format_validation_error(err: ValidationError, origins: Origins | None = None) -> list[str]:
    """One line per problem: `field.path: message  (file:line)`."""
    lines = []
    for e in err.errors():
        loc = tuple(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        for part in msg.split("\n"):
            # A cross-field message names its fields: point at the lines where those were set.
            named = [tuple(m.split(".")) for m in _FIELD_PATH.findall(part)]
            wheres = [w for w in dict.fromkeys(_where(n, origins or {}) for n in named) if w]
            if not wheres and loc:
                wheres = [w for w in [_where(loc, origins or {})] if w]
            suffix = f"  ({', '.join(wheres)})" if wheres else ""
            prefix = "" if named else f"{'.'.join(loc) or 'config'}: "
            lines.append(f"  {prefix}{part}{suffix}")
    return lines
