"""Where a raw config came from, for errors that point at it: YAML key lines, `--set` overrides, and Pydantic
errors rendered as `field.path: message  (file:line)`. Works on raw mappings; of the schema it knows only where the
discriminated unions are (`Variants` by field path), to expand their shorthand and to word their errors.

Imports only Pydantic and PyYAML, like the rest of `distrl.config`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from distrl.config.base import Variants


class ConfigError(ValueError):
    """A config could not be loaded; the message lists every problem with its field path and where it was set."""


Origins = dict[tuple[str, ...], str]
"""Where each key of the raw tree was written: `file:line` or `--set key=value`."""

VariantsByPath = Mapping[tuple[str, ...], Variants]
"""The discriminated unions of the tree, by field path (`("loss", "policy")`)."""


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


def apply_override(tree: dict[str, Any], override: str, origins: Origins | None = None,
                   variants: VariantsByPath | None = None) -> None:
    """Apply one `dotted.key=value` override to a raw (not yet validated) config mapping, in place. A union written
    as its bare tag (`loss.policy: gspo`) is expanded on the way, so `--set loss.policy.clip_high=1e-3` can refine
    it."""
    key, sep, value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {override!r}: expected key=value, e.g. --set loss.kl.coef=0.01")
    parts = tuple(key.strip().split("."))
    node = tree
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        union = (variants or {}).get(parts[: i + 1])
        if union is not None and isinstance(child, str):
            child = node[part] = union.expand(child)
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


def _without_tag(loc: tuple[str, ...], variants: VariantsByPath) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """Pydantic puts a union's tag into the path (`loss.policy.gspo.dual_clip`): the path without it, the union's
    path and the tag; `()` and `''` when `loc` runs through no union."""
    for n in range(len(loc) - 1, 0, -1):
        union = variants.get(loc[:n])
        if union is not None and loc[n] in union.classes:
            return loc[:n] + loc[n + 1 :], loc[:n], loc[n]
    return loc, (), ""


def _message(e: ErrorDetails, variants: VariantsByPath) -> tuple[tuple[str, ...], str, tuple[str, ...]]:
    """The field path to report, Pydantic's message worded for the config's unions, and the path of the union key
    that chose the variant the error is about (`()` when none)."""
    loc, union_path, tag = _without_tag(tuple(str(p) for p in e["loc"]), variants)
    msg = e["msg"].removeprefix("Value error, ")
    union = variants.get(loc)
    if e["type"] == "union_tag_invalid" and union is not None:
        return (*loc, union.key), f"{e['ctx']['tag']!r} is not one of {', '.join(dict.fromkeys(union.classes))}", ()
    if not union_path:
        return loc, msg, ()
    key = (*union_path, variants[union_path].key)
    if e["type"] == "extra_forbidden":
        union = variants[union_path]
        fields = ", ".join(union.fields(tag))
        owners = [t for t in union.tags_with(loc[-1]) if union.classes[t] is not union.classes[tag]]
        named = [repr(owner) for owner in owners]
        listed = ", ".join(named[:-1]) + " or " + named[-1] if len(named) > 1 else "".join(named)
        hint = f" ({union.key} {listed} has it)" if owners else ""
        return loc, f"not a field with {'.'.join(key)} {tag!r}, whose fields are {fields}{hint}", key
    if _FIELD_PATH.search(msg):  # a check of the variant's own, which names its fields already
        return loc, msg, ()
    return loc, f"{msg} (with {'.'.join(key)} {tag!r})", key


def format_validation_error(err: ValidationError, origins: Origins | None = None,
                            variants: VariantsByPath | None = None) -> list[str]:
    """One line per problem: `field.path: message  (file:line)`. With `variants`, an error inside a union says
    which variant it concerns and points at where that was chosen too."""
    origins = origins or {}
    lines = []
    for e in err.errors():
        loc, msg, chosen_by = _message(e, variants or {})
        for part in msg.split("\n"):
            # A cross-field message names its fields: point at the lines where those were set.
            named = [tuple(m.split(".")) for m in _FIELD_PATH.findall(part) if not chosen_by]
            # The fields it names that were written; if none was, the sections they are in.
            wheres = [origins.get(n) for n in named]
            if not any(wheres):
                wheres = [_where(n, origins) for n in named]
            if not any(wheres) and loc:
                wheres = [_where(loc, origins)]
            if chosen_by:
                wheres.append(_where(chosen_by, origins))
            found = [w for w in dict.fromkeys(wheres) if w]
            suffix = f"  ({', '.join(found)})" if found else ""
            prefix = "" if named else f"{'.'.join(loc) or 'config'}: "
            lines.append(f"  {prefix}{part}{suffix}")
    return lines
