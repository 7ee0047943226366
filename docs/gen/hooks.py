"""MkDocs hooks of the site's build: every config path named in a page's inline code must be a field of the config
(a warning, so that `mkdocs build --strict` fails on a renamed or misspelt field), and each becomes a link to its
row in the configuration reference; a list rendered into the paragraph above it is a warning too."""

from __future__ import annotations

import logging
import posixpath
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # MkDocs loads a hook by its path, not as a package

import checks

from distrl.config.fields import config_fields

log = logging.getLogger("mkdocs.hooks.config_fields")
FIELDS = config_fields()
REFERENCE = "reference/config.md"
SPAN = re.compile(r"(?<![`\[])`([^`\n]+)`(?![`\]])")


def on_page_markdown(markdown: str, page, config, files) -> str:
    for problem in checks.unknown_fields(markdown, FIELDS):
        log.warning("%s:%s names no config field (see the configuration reference)", page.file.src_uri, problem)
    target = posixpath.relpath(REFERENCE, posixpath.dirname(page.file.src_uri) or ".")
    fenced = [(m.start(), m.end()) for m in checks.FENCE.finditer(markdown)]

    def link(m: re.Match) -> str:
        if any(a <= m.start() < b for a, b in fenced) or markdown[markdown.rfind("\n", 0, m.start()) + 1] == "#":
            return m[0]  # code blocks and headings stay as they are
        paths = checks.field_mentions(m[1])
        if len(paths) != 1 or not m[1].startswith(paths[0]):
            return m[0]
        anchor = _anchor(paths[0].replace("[]", ""))
        return f"[{m[0]}]({target}#{anchor})" if anchor else m[0]

    return SPAN.sub(link, markdown)


def on_page_content(html: str, page, config, files) -> str:
    for item in checks.swallowed_lists(html):
        log.warning("%s: a list is rendered as part of the paragraph above it (put a blank line between them): %s",
                    page.file.src_uri, item)
    return html


def _anchor(path: str) -> str | None:
    """The reference's anchor of `path`: its own row, or for a deeper or other spelling, the nearest section's."""
    names = {f.path.replace("[]", "") for f in FIELDS}
    while path and path not in names:
        path = path.rpartition(".")[0]
    return next((f.path for f in FIELDS if f.path.replace("[]", "") == path), None)
