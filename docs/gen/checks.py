"""What the documentation's text is checked for, by the site's build (`hooks.py`) and by tests/test_docs.py: config
field names in inline code exist, YAML blocks that are configs validate and `distrl` command lines parse. By the build
alone: no list is rendered as part of the paragraph above it. By tests/test_docs.py alone: the links of the pages read
outside the site (README.md, CONTRIBUTING.md) lead to files and headings, and the repository's pointers into the
README's sections name sections it has.

Markdown is read the simple way every page here is written: fenced blocks open and close with ``` at the start of
a line (indented in lists), inline code is one pair of backticks.
"""

from __future__ import annotations

import copy
import functools
import re
import shlex
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import yaml

from distrl import config
from distrl.config.fields import FieldDoc, config_fields, known_path

ROOT = Path(__file__).resolve().parents[2]
BASE_CONFIG = "configs/quickstart.yaml"
"""The config a YAML fragment of the docs is read over, unless its first line names another (`# over: PATH`)."""
SECTIONS = tuple(f.path for f in config_fields() if "." not in f.path)
FILE_SUFFIXES = ("py", "yaml", "yml", "json", "jsonl", "md", "txt", "csv", "parquet", "sh", "toml", "safetensors")
FIELD = re.compile(rf"(?<![\w./$-])(?:{'|'.join(SECTIONS)})(?:\.[A-Za-z_]\w*(?:\[\])?)+(?![\w/(-])")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
                   re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"(?<!`)`((?:[^`\n]|\n(?![ \t]*\n))+)`(?!`)")  # may wrap, within a paragraph
COMMAND = re.compile(r"(?:^|;|&&|\|\||\s--\s)\s*(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\.venv/bin/)?distrl\s+")
"""Where a shell line runs `distrl`: at its start, after `;`, `&&`, `||`, or after a lone `--` (`ray job submit ...
-- distrl train ...`, not a script's `--distrl` option), behind any `VAR=value` assignments."""
SHELL_BLOCKS = ("bash", "sh", "shell")
"""Fenced blocks whose every line is a shell line."""
PROMPTED_BLOCKS = ("", "console")
"""Fenced blocks of commands and their output (benchmarks' listings): a shell line is one that starts with `$ `."""


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, its text, and the line of the page it starts on."""

    lang: str
    text: str
    line: int


def fenced_blocks(markdown: str) -> list[Block]:
    blocks = []
    for m in FENCE.finditer(markdown):
        indent = len(m["indent"])
        text = "".join(line[indent:] for line in m["body"].splitlines(keepends=True))
        blocks.append(Block(m["lang"].lower(), text, markdown.count("\n", 0, m.start()) + 1))
    return blocks


def prose(markdown: str) -> str:
    """The page without its fenced blocks (each replaced by as many blank lines, so line numbers stay right)."""
    return FENCE.sub(lambda m: "\n" * m[0].count("\n"), markdown)


def inline_code(markdown: str) -> Iterator[tuple[int, str]]:
    """(line, text) of every inline code span outside fenced blocks."""
    text = prose(markdown)
    for m in INLINE.finditer(text):
        yield text.count("\n", 0, m.start()) + 1, m[1]


def field_mentions(code: str) -> list[str]:
    """The config paths an inline code span names (`loss.kl.coef` in `--set loss.kl.coef=0.01`), file names such
    as `data.py` left out."""
    return [m[0] for m in FIELD.finditer(code) if m[0].rpartition(".")[2] not in FILE_SUFFIXES]


def unknown_fields(markdown: str, docs: list[FieldDoc] | None = None) -> list[str]:
    """`line: path` for every config path in the page's inline code that names no field."""
    docs = docs if docs is not None else config_fields()
    return [f"{line}: `{path}`" for line, code in inline_code(markdown) for path in field_mentions(code)
            if not known_path(path, docs)]


# ----------------------------------------------------------------------------------------------------- configs
def config_blocks(markdown: str) -> Iterator[tuple[Block, dict[str, Any]]]:
    """The YAML blocks that are distrl configs, parsed: every mapping but a Kubernetes manifest (`apiVersion` and
    `kind` at its top), so that a block whose sections are all misspelt is checked, not passed over."""
    for block in fenced_blocks(markdown):
        if block.lang not in ("yaml", "yml"):
            continue
        tree = yaml.safe_load(block.text)
        if isinstance(tree, dict) and not {"apiVersion", "kind"} <= set(tree):
            yield block, tree


def check_config_block(block: Block, tree: dict[str, Any]) -> None:
    """Validate a config block read over its base config (`BASE_CONFIG`, or the `# over: PATH` its first line
    names): raises ConfigError naming every bad field."""
    first = block.text.lstrip().splitlines()[0]
    base = first.split("# over:", 1)[1].strip() if first.startswith("# over:") else BASE_CONFIG
    unknown = sorted(set(tree) - set(SECTIONS))
    if unknown:
        raise config.ConfigError(f"not config sections: {unknown}")
    merged = _merge(yaml.safe_load((ROOT / base).read_text()), tree)
    config.from_dict(merged, source=f"the block over {base}")


def _merge(base: Any, over: Any) -> Any:
    """`over` laid on `base` key by key (a mapping that names a variant's tag replaces the base's section)."""
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return copy.deepcopy(over)
    tags = {"type", "mode", "target"}
    if any(k in over and k in base and over[k] != base[k] for k in tags):
        return copy.deepcopy(over)
    out = copy.deepcopy(base)
    for key, value in over.items():
        out[key] = _merge(out.get(key), value)
    return out


# ---------------------------------------------------------------------------------------------------- commands
def command_lines(markdown: str) -> Iterator[tuple[int, list[str]]]:
    """(line, argv after `distrl`) of every `distrl ...` command in the page's shell blocks, in the `$ ` lines of its
    unlabelled and console blocks, and in inline code that is a whole command line: `distrl`, a subcommand and at
    least two arguments, none of them `[optional]`, `...` or `<placeholder>` (`distrl train` or `distrl export
    --merge` in a sentence name a command and a flag)."""
    for block in fenced_blocks(markdown):
        if block.lang in SHELL_BLOCKS + PROMPTED_BLOCKS:
            command, start = "", 0
            prompted = block.lang in PROMPTED_BLOCKS
            for offset, line in enumerate(block.text.split("\n")):
                if prompted and not command and not line.startswith("$ "):
                    continue  # output (a continued line carries on its command)
                shell = line.removeprefix("$ ") if prompted and not command else line
                command, start = command + shell, start if command else block.line + 1 + offset
                if command.endswith("\\"):  # continued on the next line
                    command = command[:-1] + " "
                    continue
                yield from _commands(start, command)
                command = ""
    for line, span in inline_code(markdown):
        code = " ".join(span.split())
        if re.match(r"(\.venv/bin/)?distrl \S+ \S+ \S", code) and not any(s in code for s in ("[", "...", "<")):
            yield from _commands(line, code)


def _commands(line: int, text: str) -> Iterator[tuple[int, list[str]]]:
    for m in COMMAND.finditer(text):
        words = shlex.split(text[m.end():], comments=True)
        for end, word in enumerate(words):
            if word in ("&&", "||", ";", "|") or word.startswith(">"):
                words = words[:end]
                break
        yield line, words


def check_command(argv: list[str]) -> None:
    """Parse `distrl argv` as the CLI would; a config it names is loaded with its `--set` overrides, a config that is
    not in the repository (`my_job.yaml`) replaced by `BASE_CONFIG`. Raises SystemExit (argparse) or ConfigError."""
    from distrl.cli import build_parser

    args = build_parser().parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return
    if (ROOT / path).is_file():
        config.load(ROOT / path, args.overrides)
    elif args.overrides:
        try:
            config.load(ROOT / BASE_CONFIG, args.overrides)
        except config.ConfigError as err:
            raise config.ConfigError(f"{path} is not in the repository; its --set overrides over {BASE_CONFIG}: "
                                     f"{err}") from None


# --------------------------------------------------------------------------------------------------- rendering
@functools.cache
def _site_markdown() -> Any:
    """A Markdown converter with the site's extensions and their settings, read from mkdocs.yml (its hooks and
    plugins left out: they change no Markdown setting)."""
    import markdown
    from mkdocs.config import load_config

    site = load_config(str(ROOT / "mkdocs.yml"), hooks=[], plugins=[])
    return markdown.Markdown(extensions=site.markdown_extensions, extension_configs=site.mdx_configs)


@functools.lru_cache(maxsize=32)
def render(page: str) -> tuple[str, list[dict[str, Any]]]:
    """The page's HTML as the site renders it, and its headings (toc tokens, flattened)."""
    converter = _site_markdown()
    converter.reset()
    html = converter.convert(page)
    tokens, todo = [], list(converter.toc_tokens)
    while todo:
        token = todo.pop(0)
        tokens.append(token)
        todo[:0] = token["children"]
    return html, tokens


def headings(page: str) -> list[str]:
    """The text of the page's headings, in order."""
    return [token["name"] for token in render(page)[1]]


def anchors(page: str) -> set[str]:
    """The anchors of the page's headings that lead to them both in the site (Python-Markdown's toc with the site's
    settings: its `slugify`, `_1` on a repeat) and on GitHub, where README.md and CONTRIBUTING.md are read (lower
    case, punctuation but `-` and `_` dropped, each space a hyphen, `-1` on a repeat)."""
    site, github, seen = set(), set(), Counter[str]()
    for token in render(page)[1]:
        site.add(token["id"])
        slug = re.sub(r"[^\w\- ]", "", token["name"].lower()).replace(" ", "-")
        github.add(f"{slug}-{seen[slug]}" if seen[slug] else slug)
        seen[slug] += 1
    return site & github


SWALLOWED_LIST = re.compile(r"<p>(?:(?!</p>).)*?\n((?:[-*+]|\d+\.) [^\n]*)", re.DOTALL)


def swallowed_lists(html: str) -> list[str]:
    """The first item of each list that a rendered page holds as text of the paragraph above it: Python-Markdown,
    unlike GitHub, starts a list only after a blank line."""
    return [re.sub(r"<[^>]+>", "", m[1]) for m in SWALLOWED_LIST.finditer(html)]


# ------------------------------------------------------------------------------------------------------- links
SCHEME = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)
"""A link that leaves the repository (https:, mailto:, //host)."""


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "a" and found.get("href") and found.get("class") != "headerlink":  # not a heading's own permalink
            self.targets.append(str(found["href"]))
        elif tag == "img" and found.get("src"):
            self.targets.append(str(found["src"]))


def links(page: str) -> list[str]:
    """The targets of the page's links and images, as the site's Markdown finds them (none in code)."""
    parser = _Links()
    parser.feed(render(page)[0])
    return parser.targets


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """`line: link: why` for each relative link of a page read outside the site (the site's build checks its own
    pages) that leads nowhere: its file or directory must be in the repository, and an anchor into a Markdown page
    must be one of that page's heading anchors (`anchors`). Links that leave the repository are not followed."""
    text, problems = page.read_text(), []
    for link in links(text):
        if SCHEME.match(link):
            continue
        path, _, anchor = unquote(link).partition("#")
        target = (page.parent / path).resolve() if path else page.resolve()
        line = text.count("\n", 0, max(text.find(link), 0)) + 1
        if path.startswith("/") or not target.is_relative_to(root.resolve()) or not target.exists():
            problems.append(f"{line}: {link}: no such file or directory in the repository")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
            problems.append(f"{line}: {link}: no heading of {target.relative_to(root.resolve())} has the anchor "
                            f"#{anchor} (both in the site and on GitHub)")
    return problems


# ------------------------------------------------------------------------------------ pointers into the README
README_POINTER = re.compile(
    r"(?<![\w/.-])README(?:\.md)?(?:'s)?[,:]?[ \t]+\"([^\"\n]+)\""       # README, "X" / README "X" / README's "X"
    r"|(?<![\w/.-])README(?:\.md)?:[ \t]+([^\"\s][^)\n]*?)[ \t]*(?:\)|$)"  # README: X, to a ")" or the line's end
    r"|(?<![\w/.-])README\.md#([\w-]+)",                                     # README.md#anchor
    re.MULTILINE)


def readme_pointers(text: str, readme: str) -> list[str]:
    """`line: pointer` for each pointer in a file's text to a section of the README that it does not have:
    `README, "X"`, `README "X"`, `README's "X"` and `README: X` name a heading (in any case), `README.md#x` one of
    its anchors. A section moved to the documentation site is pointed at by its page (docs/failures.md)."""
    names = {name.lower() for name in headings(readme)}
    found = []
    for m in README_POINTER.finditer(text):
        name, anchor = m[1] or m[2], m[3]
        if (name is not None and name.strip().lower() not in names) or (anchor and anchor not in anchors(readme)):
            line = text.count("\n", 0, m.start()) + 1
            found.append(f"{line}: {m[0].strip().removesuffix(')')}")
    return found
