"""Whether `kernels: liger` can run, checked before any actor starts (the preflight's check) without importing
torch, Triton or liger-kernel: the package is installed, and the model's type (its config.json's `model_type`) is
among those liger-kernel patches (its own table, `MODEL_TYPE_TO_APPLY_LIGER_FN`, read from its source).

A role whose `liger` the config asked for is refused with the reason; one whose `liger` came from the GPU default
(`distrl.config.gpu_defaults`) falls back to `plain`, with a printed note, so that a GPU run without the `kernels`
extra, or of a model liger-kernel does not know, still starts.
"""

from __future__ import annotations

import ast
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from distrl.config import Config
from distrl.console import say

LIGER_TABLE = "MODEL_TYPE_TO_APPLY_LIGER_FN"
"""liger-kernel's table of the model types it patches (`liger_kernel/transformers/monkey_patch.py`)."""


def liger_model_types() -> frozenset[str] | None:
    """The model types the installed liger-kernel patches, read from its source; None when it is not installed."""
    spec = importlib.util.find_spec("liger_kernel")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    source = Path(next(iter(spec.submodule_search_locations))) / "transformers" / "monkey_patch.py"
    tree = ast.parse(source.read_text(), str(source))
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        named = any(isinstance(target, ast.Name) and target.id == LIGER_TABLE for target in node.targets)
        if named and isinstance(node.value, ast.Dict):
            return frozenset(key.value for key in node.value.keys
                             if isinstance(key, ast.Constant) and isinstance(key.value, str))
    raise RuntimeError(f"liger-kernel's {source} has no {LIGER_TABLE} table: distrl cannot tell which models it "
                       f"patches (the `kernels` extra pins the release distrl was tested with)")


def liger_problem(model_dir: str | None) -> str | None:
    """Why liger-kernel cannot patch the model in `model_dir` (None: not known yet, e.g. a tiny model still to be
    built, and only the package is checked), or None when it can."""
    types = liger_model_types()
    if types is None:
        return "liger-kernel is not installed here (distrl's `kernels` extra: pip install 'distrl[kernels]')"
    config = Path(model_dir) / "config.json" if model_dir else None
    if config is None or not config.is_file():
        return None
    model_type = json.loads(config.read_text()).get("model_type")
    if model_type not in types:
        return f"liger-kernel has no kernels for the model's type {model_type!r} ({config})"
    return None


def check_liger(cfg: Config, model_dir: Callable[[str], str | None]) -> list[str]:
    """The roles of `cfg` whose `kernels` is `liger` (the learner, the critic, the reference when there is one),
    each checked against its model (`model_dir(path)`: the local directory of a model path, None when unknown):
    returns a problem for each whose config asked for liger and it cannot run; one whose liger came from the GPU
    default is set to `plain` and a note printed."""
    problems = []
    roles = [("learner", cfg.learner, None), ("critic", cfg.critic, cfg.critic.path if cfg.critic else None),
             ("reference", cfg.reference if cfg.needs_reference else None, cfg.reference.path)]
    for name, section, path in roles:
        if section is None or section.kernels != "liger":
            continue
        why = liger_problem(model_dir(path or cfg.model.path))
        if why is None:
            continue
        if "kernels" in section.model_fields_set:
            problems.append(f"{name}.kernels 'liger': {why}; set {name}.kernels: plain or compile")
        else:
            section.kernels = "plain"
            section.__pydantic_fields_set__.discard("kernels")  # still a default, not the config's own setting
            say(f"{name}.kernels: plain, not the GPU default liger: {why}")
    return problems
