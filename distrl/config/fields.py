"""The config tree as documentation: every field of every section, walked from the Pydantic models themselves, with
its path, type, default, constraints and docstring. The configuration reference (docs/reference/config.md) is
generated from it at build time, and the documentation's checks of field names (`known_path`) read it, so neither
can drift from the code.

Paths are spelled as a user writes them: YAML keys (`algorithm.lambda`, `env.class`), list items as `[]`
(`eval.sets[].name`). A variant's fields are under the union's path (`loss.policy.dual_clip` of `type: ppo`).
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, Union

import annotated_types
import yaml
from pydantic import AliasChoices, BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from distrl.config.base import Section
from distrl.config.root import Config

OTHER_SPELLINGS = {"run.tensorboard": "run.trackers"}
"""Keys the config still reads that are no field of their own (a validator turns them into one): each with the
field it sets. `data.prompt_key` is not listed: its field names it as a validation alias."""


@dataclass(frozen=True)
class FieldDoc:
    """One field: `path` (`loss.kl.coef`), the `table` it is listed in (its section's path), the `variant` that owns
    it (`type: gspo`; None outside unions), its `type`, `default` ("required" or YAML), `constraints` and `doc`."""

    path: str
    table: str
    variant: str | None
    type: str
    default: str
    constraints: str
    doc: str
    aliases: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


def config_fields(model: type[BaseModel] = Config, prefix: str = "") -> list[FieldDoc]:
    """Every field of `model` and of the sections under it, depth first, in declaration order."""
    out: list[FieldDoc] = []
    _walk(model, prefix, None, out)
    return out


def known_path(path: str, docs: list[FieldDoc] | None = None) -> bool:
    """Whether `path` (`loss.kl.coef`, `eval.sets.name` or `eval.sets[].name`, `cluster.rollout`) names a field or
    a section of the config, or a key it still reads under another spelling."""
    path = path.replace("[]", "")
    if path in OTHER_SPELLINGS:
        return True
    for doc in docs if docs is not None else config_fields():
        names = [doc.path.replace("[]", ""), *(doc.path.rpartition(".")[0] + "." + a if "." in doc.path else a
                                               for a in doc.aliases)]
        if path in names:
            return True
    return False


def _walk(model: type[BaseModel], prefix: str, variant: str | None, out: list[FieldDoc]) -> None:
    for name, info in model.model_fields.items():
        key = info.alias or name
        path = f"{prefix}.{key}" if prefix else key
        annotation, metadata = _unwrap(info.annotation)
        tag = info.discriminator if isinstance(info.discriminator, str) else _members(annotation)[1]
        out.append(FieldDoc(path=path, table=prefix, variant=variant, type=_type_name(annotation),
                            default=_default(info, tag), constraints=_constraints([*info.metadata, *metadata]),
                            doc=" ".join((info.description or "").split()), aliases=_aliases(info, key)))
        for suffix, section, label in _sections(annotation, tag):
            _walk(section, path + suffix, label, out)


def _unwrap(annotation: Any) -> tuple[Any, list[Any]]:
    """The type inside `Annotated[...]` layers, and their metadata."""
    metadata: list[Any] = []
    while typing.get_origin(annotation) is typing.Annotated:
        annotation, *extra = typing.get_args(annotation)
        metadata += extra
    return annotation, metadata


def _members(annotation: Any) -> tuple[list[Any], str | None]:
    """The types a field may hold, nested unions flattened, and the discriminator of a tagged union among them."""
    annotation, metadata = _unwrap(annotation)
    key = next((m.discriminator for m in metadata if isinstance(getattr(m, "discriminator", None), str)), None)
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return [annotation], key
    out: list[Any] = []
    for member in typing.get_args(annotation):
        inner, inner_key = _members(member)
        out += inner
        key = key or inner_key
    return out, key


def _is_section(t: Any) -> bool:
    return isinstance(t, type) and issubclass(t, Section)


def _sections(annotation: Any, key: str | None) -> list[tuple[str, type[BaseModel], str | None]]:
    """The sections a field holds: (path suffix, class, variant label) for a section, each variant of a tagged
    union (told apart by `key`), or the items of a list of sections."""
    suffix = ""
    if typing.get_origin(annotation) is list:
        suffix, annotation = "[]", typing.get_args(annotation)[0]
        members, key = _members(annotation)
    else:
        members = _members(annotation)[0]
    classes = [m for m in members if _is_section(m)]
    if len(classes) == 1 or key is None:
        return [(suffix, c, None) for c in classes]
    return [(suffix, c, f"{key}: {' | '.join(_literals(c.model_fields[key].annotation))}") for c in classes]


def _literals(annotation: Any) -> list[str]:
    return [str(v) for v in typing.get_args(annotation)]


def _type_name(t: Any) -> str:
    members, _ = _members(t)
    if len(members) > 1:
        names = [_type_name(m) for m in members]
        return " | ".join(n for i, n in enumerate(names) if n not in names[:i])  # one "section" for a union's
    t = members[0]
    origin = typing.get_origin(t)
    if origin is Literal:
        return " | ".join(f'"{v}"' if isinstance(v, str) else _yaml(v) for v in typing.get_args(t))
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in typing.get_args(t) if a is not Ellipsis)}]"
    if t is type(None):
        return "null"
    if _is_section(t):
        return "section"
    return getattr(t, "__name__", str(t))


def _default(info: FieldInfo, key: str | None) -> str:
    """The default as YAML; a section's as its variant's tag (`{type: replicate}`), or "its fields' defaults"."""
    if info.default_factory is not None:
        value = info.default_factory()  # type: ignore[call-arg]  # distrl's factories take no arguments
    elif info.default is PydanticUndefined:
        return "required"
    else:
        value = info.default
    if isinstance(value, BaseModel):
        return _yaml({key: getattr(value, key)}) if key else "its fields' defaults"
    return _yaml(value)


def _yaml(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


CONSTRAINTS = {annotated_types.Gt: ("gt", "> {}"), annotated_types.Ge: ("ge", ">= {}"),
               annotated_types.Lt: ("lt", "< {}"), annotated_types.Le: ("le", "<= {}"),
               annotated_types.MinLen: ("min_length", "at least {} long"),
               annotated_types.MaxLen: ("max_length", "at most {} long"),
               annotated_types.MultipleOf: ("multiple_of", "a multiple of {}")}


def _constraints(metadata: list[Any]) -> str:
    out = []
    for meta in metadata:
        for cls, (attr, text) in CONSTRAINTS.items():
            if isinstance(meta, cls):
                out.append(text.format(getattr(meta, attr)))
    return ", ".join(out)


def _aliases(info: FieldInfo, key: str) -> tuple[str, ...]:
    choices = info.validation_alias.choices if isinstance(info.validation_alias, AliasChoices) else []
    return tuple(c for c in choices if isinstance(c, str) and c != key)
