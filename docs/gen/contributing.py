"""Puts CONTRIBUTING.md (the house rules, kept at the repository's root where contributors look) into the site as
contributing.md at build time (mkdocs-gen-files runs it)."""

from pathlib import Path

import mkdocs_gen_files

with mkdocs_gen_files.open("contributing.md", "w") as page:
    page.write((Path(__file__).resolve().parents[2] / "CONTRIBUTING.md").read_text())
