"""The documentation says only what the code does: every YAML block in README.md, CONTRIBUTING.md and docs/ that is a
config (any mapping but a Kubernetes manifest) validates (read over configs/quickstart.yaml, or the config its first
line names with `# over: PATH`), every `distrl ...` command line (of shell blocks, and the `$ ` lines of unlabelled
ones) parses and loads its config with its `--set` overrides (over configs/quickstart.yaml when the config is not in
the repository), and every config field named in inline code exists. README.md and CONTRIBUTING.md, read outside the
site, have their links and anchors checked here; `make docs` builds the site in strict mode (broken links and
anchors, pages left out of the navigation, unknown fields), and `make test` runs it. Pointers into the README's
sections from anywhere in the repository name sections it has, and the README draws the roles as the site's home page
does."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from distrl.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE_THE_SITE = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
PAGES = [*OUTSIDE_THE_SITE,
         *sorted(p for p in (ROOT / "docs").rglob("*.md") if "gen" not in p.relative_to(ROOT / "docs").parts)]


def _checks():
    spec = importlib.util.spec_from_file_location("distrl_docs_checks", ROOT / "docs" / "gen" / "checks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


checks = _checks()


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_the_pages_are_found():
    names = {page_id(p) for p in PAGES}
    assert {"README.md", "docs/index.md", "docs/getting-started.md", "docs/BENCHMARKS.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_config_block_validates(page):
    for block, tree in checks.config_blocks(page.read_text()):
        try:
            checks.check_config_block(block, tree)
        except ConfigError as err:
            pytest.fail(f"{page_id(page)}:{block.line}: this config block does not validate:\n{err}")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_distrl_command_line_parses(page, capsys):
    for line, argv in checks.command_lines(page.read_text()):
        try:
            checks.check_command(argv)
        except SystemExit:
            pytest.fail(f"{page_id(page)}:{line}: `distrl {' '.join(argv)}` does not parse: {capsys.readouterr().err}")
        except ConfigError as err:
            pytest.fail(f"{page_id(page)}:{line}: `distrl {' '.join(argv)}`: {err}")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_config_field_named_exists(page):
    assert checks.unknown_fields(page.read_text()) == []


def test_the_docs_hold_configs_and_commands_to_check():
    """A check that finds nothing cannot fail: the pages hold many of each."""
    text = "\n".join(p.read_text() for p in PAGES)
    assert len(list(checks.config_blocks(text))) >= 10
    assert len(list(checks.command_lines(text))) >= 10
    assert sum(len(checks.field_mentions(code)) for _, code in checks.inline_code(text)) >= 150
    assert len(checks.links((ROOT / "README.md").read_text())) >= 10


MARKDOWN = '''Set `loss.kl.coef` and `loss.kl.coeff`, not `data.py` or `distrl.data.stream`; `eval.sets[].name` is one.

```yaml
loss: {kl: {coef: 0.01}}
```

```yaml
# over: configs/grpo-gsm8k.yaml
loss: {policy: {type: gspo, dual_clip: 3.0}}
```

```yaml
apiVersion: v1
kind: Secret
```

```bash
X=1 .venv/bin/distrl train --config configs/quickstart.yaml --set run.steps=2 \\
  --set loss.kl.coef=0.01   # a comment
ray job submit --address http://127.0.0.1:8265 -- distrl validate configs/quickstart.yaml --set loop=async
distrl eval --checkpoint x
```

`distrl train --config configs/quickstart.yaml --set run.stepz=3` and `distrl train` (a name).
'''


def test_what_the_checks_find_and_refuse():
    assert checks.unknown_fields(MARKDOWN) == ["1: `loss.kl.coeff`", "24: `run.stepz`"]
    blocks = list(checks.config_blocks(MARKDOWN))
    assert [tree for _, tree in blocks] == [{"loss": {"kl": {"coef": 0.01}}},
                                            {"loss": {"policy": {"type": "gspo", "dual_clip": 3.0}}}]
    checks.check_config_block(*blocks[0])
    with pytest.raises(ConfigError, match=r"(?s)over configs/grpo-gsm8k.yaml.*dual_clip"):
        checks.check_config_block(*blocks[1])
    commands = list(checks.command_lines(MARKDOWN))
    assert commands == [
        (18, ["train", "--config", "configs/quickstart.yaml", "--set", "run.steps=2", "--set", "loss.kl.coef=0.01"]),
        (20, ["validate", "configs/quickstart.yaml", "--set", "loop=async"]),
        (21, ["eval", "--checkpoint", "x"]),
        (24, ["train", "--config", "configs/quickstart.yaml", "--set", "run.stepz=3"])]
    checks.check_command(commands[0][1])
    checks.check_command(commands[1][1])
    with pytest.raises(SystemExit):
        checks.check_command(commands[2][1])  # --config is required
    with pytest.raises(ConfigError, match="stepz"):
        checks.check_command(commands[3][1])


@pytest.mark.parametrize("page", OUTSIDE_THE_SITE, ids=page_id)
def test_every_link_of_a_page_read_outside_the_site_leads_somewhere(page):
    assert checks.broken_links(page) == []


def test_what_the_link_check_refuses(tmp_path):
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "page.md").write_text("# A page\n\n## Sync -> async\n\n## Twice\n\n## Twice\n")
    (tmp_path / "outside.md").write_text("# Outside\n")
    (root / "README.md").write_text("""# Front

[a page](docs/page.md), [its title](docs/page.md#a-page), [here](#front), [the first](docs/page.md#twice)
[a site](https://example.com/gone.md) and `[code](gone.md)` are not followed
[gone](docs/gone.md)
[outside](../outside.md)
[no such heading](docs/page.md#nowhere)
[the site's](docs/page.md#sync-async) and [GitHub's](docs/page.md#sync---async) anchor of "Sync -> async"
[the site's](docs/page.md#twice_1) and [GitHub's](docs/page.md#twice-1) anchor of the second "Twice"
""")
    why = "no heading of docs/page.md has the anchor #{} (both in the site and on GitHub)"
    assert checks.broken_links(root / "README.md", root) == [
        "5: docs/gone.md: no such file or directory in the repository",
        "6: ../outside.md: no such file or directory in the repository",
        f"7: docs/page.md#nowhere: {why.format('nowhere')}",
        f"8: docs/page.md#sync-async: {why.format('sync-async')}",
        f"8: docs/page.md#sync---async: {why.format('sync---async')}",
        f"9: docs/page.md#twice_1: {why.format('twice_1')}",
        f"9: docs/page.md#twice-1: {why.format('twice-1')}"]


def test_a_list_right_under_a_paragraph_line_is_found():
    """The site's build warns of it (docs/gen/hooks.py), so that `mkdocs build --strict` fails."""
    assert checks.swallowed_lists(checks.render("Reading:\n- one\n- two\n\nThen:\n\n- three\n")[0]) == ["- one"]


def repository_files() -> list[Path]:
    """The repository's files, committed or new (not those git ignores)."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    return [ROOT / name for name in names if name and (ROOT / name).is_file()]


def test_pointers_into_the_readme_name_its_sections():
    """A section that moved from the README to the site is pointed at by its page. The check's own files, which
    spell out the pointers it refuses, are left out."""
    readme = (ROOT / "README.md").read_text()
    found = []
    for path in repository_files():
        if path in (Path(__file__).resolve(), ROOT / "docs" / "gen" / "checks.py"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue  # not text
        found += [f"{path.relative_to(ROOT)}:{pointer}" for pointer in checks.readme_pointers(text, readme)]
    assert found == []


def test_what_the_readme_pointer_check_refuses():
    readme = "# distrl\n\n## The roles\n\n## Your own job\n"
    text = """See README, "The roles", and the README's "your own job"; README.md#the-roles is its anchor.
run (README, "Failures and recovery").
image: x   # the image you pushed (README: Running on Kubernetes)
README "A model that learns to use a calculator", README.md#failures-and-recovery
deploy/schemas/README.md "x" is another README, and README.md is a file name.
"""
    assert checks.readme_pointers(text, readme) == [
        '2: README, "Failures and recovery"', "3: README: Running on Kubernetes",
        '4: README "A model that learns to use a calculator"', "4: README.md#failures-and-recovery"]


def test_a_block_of_misspelt_sections_is_a_config_and_a_manifest_is_not():
    text = "```yaml\nrolout: {prompts_per_step: 4}\n```\n\n```yaml\napiVersion: v1\nkind: Secret\n```\n"
    ((block, tree),) = checks.config_blocks(text)
    assert tree == {"rolout": {"prompts_per_step": 4}}
    with pytest.raises(ConfigError, match="rolout"):
        checks.check_config_block(block, tree)


def test_the_overrides_of_a_config_outside_the_repository_are_read_over_the_quickstart():
    checks.check_command(["train", "--config", "my_job.yaml", "--set", "run.steps=3"])
    with pytest.raises(ConfigError, match=r"(?s)my_job.yaml is not in the repository.*configs/quickstart.yaml.*stepz"):
        checks.check_command(["train", "--config", "my_job.yaml", "--set", "run.stepz=3"])


LISTING = """A benchmark's listing: commands after `$ `, then what they printed.

```
$ distrl train --config configs/quickstart.yaml --set run.stepz=3   # 30 steps
distrl     wall    20.56 ms
--- distrl, hybrid (round 1 of 2) --- steady 0.567 s/step
$ PYTHONPATH=. python bench/bench_trl.py --distrl hybrid,apart \\
      --rounds 2
$ OMP_NUM_THREADS=2 .venv/bin/distrl validate configs/quickstart.yaml \\
      --set loop.mode=async
distrl validate configs/quickstart.yaml --set loop.mode=asink
```
"""


def test_the_command_lines_of_a_listing_are_its_prompted_lines():
    commands = list(checks.command_lines(LISTING))
    assert commands == [(4, ["train", "--config", "configs/quickstart.yaml", "--set", "run.stepz=3"]),
                        (9, ["validate", "configs/quickstart.yaml", "--set", "loop.mode=async"])]
    with pytest.raises(ConfigError, match="stepz"):
        checks.check_command(commands[0][1])
    checks.check_command(commands[1][1])


def test_the_readme_draws_the_roles_as_the_sites_home_page_does():
    """README.md (read on GitHub) and docs/index.md (the site's home page) hold the same diagram, written twice."""
    def diagrams(page: str) -> list[str]:
        return [block.text for block in checks.fenced_blocks((ROOT / page).read_text()) if block.lang == "mermaid"]

    readme = diagrams("README.md")
    assert readme and all(diagram in diagrams("docs/index.md") for diagram in readme)
