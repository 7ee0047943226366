"""Writes the reference pages at build time (mkdocs-gen-files runs it): reference/config.md from the Pydantic models
(`distrl.config.fields`) and reference/cli.md from the CLI's argparse parser. Nothing here is written by hand, so
neither page can drift from the code."""

from __future__ import annotations

import argparse
import os

import mkdocs_gen_files

from distrl.cli import build_parser
from distrl.config.fields import OTHER_SPELLINGS, FieldDoc, config_fields

CONFIG_INTRO = """# Configuration reference

Every field of the config, generated from the Pydantic models in `distrl/config/` when this site is built: its
type, its default, the values it accepts and its docstring. Unknown keys are errors; a bad value is reported with
the field's path (and the file and line it came from). `distrl validate CONFIG` prints a config with every default
filled in; `--set path=value` overrides a field from the command line (YAML values: `--set loss.kl.coef=0.01`,
`--set loss.policy=gspo`).

Sections that are one of several different things are tagged unions: the tag (`type`, `mode`, `target`) chooses the
variant, a field of one variant cannot be written under another, a mapping without the tag is the default variant,
and the bare tag is shorthand for that variant with its defaults (`loss.policy: gspo`). Their fields are listed per
variant. List items are written `[]` (`eval.sets[].name`).
"""


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def code(text: str) -> str:
    """Inline code in a table cell: Python-Markdown's tables do not split cells at a `|` inside backticks."""
    return f"`{text}`" if text else ""


def config_page(fields: list[FieldDoc]) -> str:
    lines = [CONFIG_INTRO]
    sections = {f.path: f for f in fields if f.type.startswith("section") or f.type.startswith("list[section")}
    tables: dict[tuple[str, str | None], list[FieldDoc]] = {}
    for f in fields:
        tables.setdefault((f.table, f.variant), []).append(f)
    anchored: set[str] = set()
    for (table, variant), rows in tables.items():
        if not table:
            continue  # the root's fields are the sections themselves
        depth = table.replace("[]", "").count(".")
        title = f"`{table}`" + (f" with `{variant}`" if variant else "")
        lines.append(f"\n{'#' * min(depth + 2, 4)} {title}\n")
        if table not in anchored:  # the section's own description, once (before its first variant's table)
            owner = sections[table.removesuffix("[]")]
            lines.append(f"{owner.doc} Type: {code(owner.type)}; default: {code(owner.default)}.\n")
            anchored.add(table)
        lines.append("| field | type | default | constraints | description |")
        lines.append("|---|---|---|---|---|")
        for f in rows:
            anchor = "" if f.path in anchored else f'<span id="{f.path}"></span>'
            anchored.add(f.path)
            aliases = "".join(f" Also spelled `{a}`." for a in f.aliases)
            lines.append(f"| {anchor}{code(f.name)} | {code(f.type)} | {code(f.default)} | {cell(f.constraints)} | "
                         f"{cell(f.doc)}{aliases} |")
    lines.append("\n## Other spellings\n")
    lines.append("Keys that are still read, each turned into the field it sets:\n")
    lines += [f"- `{old}`: sets `{new}` (see its description)." for old, new in OTHER_SPELLINGS.items()]
    return "\n".join(lines) + "\n"


def cli_page(parser: argparse.ArgumentParser) -> str:
    lines = ["# Command-line reference", "",
             "`distrl`'s help text, generated from its argparse parser (`distrl/cli.py`) when this site is built.", "",
             "```text", parser.format_help().rstrip(), "```"]
    for action in parser._actions:  # argparse offers no public way to list subcommands
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                lines += ["", f"## `distrl {name}`", "", "```text", sub.format_help().rstrip(), "```"]
    return "\n".join(lines) + "\n"


os.environ["COLUMNS"] = "110"  # argparse wraps help text to the terminal's width: the same on every machine
with mkdocs_gen_files.open("reference/config.md", "w") as page:
    page.write(config_page(config_fields()))
with mkdocs_gen_files.open("reference/cli.md", "w") as page:
    page.write(cli_page(build_parser()))
