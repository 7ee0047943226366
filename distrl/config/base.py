"""What every section shares: the strict base model, the common value types, and `Variants`, the description of a
discriminated union (one section that is one of several different things, told apart by one key).

A union accepts three spellings: a mapping with its tag (`{type: gspo, clip_high: 4.0e-4}`), a mapping without it
(the default variant), and the bare tag as shorthand for that variant with its defaults (`gspo`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

Dtype = Literal["float32", "bfloat16", "float16"]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, assignments are re-validated, docstrings become descriptions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)


@dataclass(frozen=True)
class Variants:
    """A discriminated union: the `key` that names the variant, the tag a mapping without it gets (`default`), and
    the section class of each tag (`classes`; one class may carry several tags)."""

    key: str
    default: str
    classes: dict[str, type[Section]] = field(hash=False)

    def expand(self, value: Any) -> Any:
        """The raw value with its tag made explicit: `'gspo'` -> `{key: 'gspo'}`, `{...}` -> `{key: default, ...}`.
        Anything else (a built section, a wrong type) passes through for Pydantic to accept or report."""
        if isinstance(value, str):
            return {self.key: value}
        if isinstance(value, dict) and self.key not in value:
            return {self.key: self.default, **value}
        return value

    @property
    def shorthand(self) -> BeforeValidator:
        """The validator to put in the union's `Annotated[...]`, after `Field(discriminator=key)`."""
        return BeforeValidator(self.expand)

    def fields(self, tag: str) -> list[str]:
        """The fields a variant accepts, for errors that list them."""
        return list(self.classes[tag].model_fields)

    def tags_with(self, field_name: str) -> list[str]:
        """The tags whose variant has `field_name`, for errors that say where a misplaced field belongs."""
        return [tag for tag, cls in self.classes.items() if field_name in cls.model_fields]


def refuse_moved(data: Any, section: str, moved: dict[str, str]) -> Any:
    """For a `mode="before"` validator: fields that moved into a variant are errors saying what to write instead.

    `moved` maps an old key of `section` to its new place, spelled with `{value}` for the value that was written.
    """
    if isinstance(data, dict):
        lines = [f"{section}.{key} is now {moved[key].format(value=_yaml_scalar(data[key]))}"
                 for key in moved if key in data]
        if lines:
            raise ValueError("\n".join(lines))
    return data


def _yaml_scalar(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
