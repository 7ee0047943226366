"""Names on the Hugging Face Hub -> local directories, through the Hugging Face cache: the one place where
`model.path` (and `model.tokenizer`, `reference.path`, `critic.path`) and a hub-named `data.path` are resolved.

A hub name resolves to the directory of its snapshot in the hub cache (`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
`~/.cache/huggingface/hub`), downloaded first when the hub is reachable, read from the cache alone when
`HF_HUB_OFFLINE` (or, for data sets, `HF_DATASETS_OFFLINE`) is set: exactly what `hf download NAME` (older
huggingface_hub: `huggingface-cli download NAME`) writes there beforehand. Every role that loads a model, on any
node, goes through `local_dir`, so the learners (whose FSDP reader lists a local directory), the reference and the
vLLM engines all read the same snapshot.

The cache and the offline switches are read from the environment at each call (huggingface_hub reads them once, at
import), so a process that sets them before its first resolution is honoured.

Light at import time: huggingface_hub is imported by the function that downloads.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Literal

__all__ = ["HubError", "hub_cache", "is_hub_name", "local_dir", "offline"]

RepoType = Literal["model", "dataset"]

# A hub repository id: `name` or `namespace/name`, of letters, digits, `-`, `_` and `.` (no leading `.` or `-`).
HUB_NAME = re.compile(r"^[A-Za-z0-9_][\w.-]*(/[A-Za-z0-9_][\w.-]*)?$")

# A model's files besides the weights: what the tokenizer, the config and preflight need.
MODEL_METADATA = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py", "tokenizer*"]
# Weight formats no role here reads (TensorFlow, Flax, ONNX, GGUF, Core ML, OpenVINO, Meta's consolidated
# checkpoints): skipped, as vLLM skips them, so that a repository holding several formats is not fetched whole.
UNUSED_WEIGHTS = ["*.h5", "*.msgpack", "*.ot", "*.onnx", "*.onnx_data", "onnx/*", "*.gguf", "*.tflite",
                  "*.mlmodel", "coreml/*", "openvino/*", "original/*", "*.pth"]

TRUE = ("1", "ON", "YES", "TRUE")  # huggingface_hub's spelling of a true switch


class HubError(ValueError):
    """A hub name cannot be resolved; the one-line message says where it was looked for and how to pre-download it."""


def offline(repo_type: RepoType) -> bool:
    """Whether the hub may not be contacted: `HF_HUB_OFFLINE`, or for data sets also `HF_DATASETS_OFFLINE`."""
    switches = ["HF_HUB_OFFLINE"] + (["HF_DATASETS_OFFLINE"] if repo_type == "dataset" else [])
    return any(os.environ.get(s, "").upper() in TRUE for s in switches)


def hf_home() -> Path:
    """Hugging Face's root cache directory, as huggingface_hub and datasets compute it."""
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(os.environ.get("HF_HOME") or Path(xdg) / "huggingface").expanduser()


def hub_cache() -> Path:
    """The hub cache (`models--ORG--NAME/`, `datasets--ORG--NAME/`, each with `refs/` and `snapshots/<commit>/`)."""
    explicit = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    return Path(explicit).expanduser() if explicit else hf_home() / "hub"


def datasets_cache() -> Path:
    """Where `datasets` writes the Arrow tables it prepares (`$HF_DATASETS_CACHE`, else `$HF_HOME/datasets`)."""
    explicit = os.environ.get("HF_DATASETS_CACHE")
    return Path(explicit).expanduser() if explicit else hf_home() / "datasets"


def is_hub_name(path: str, file_suffixes: tuple[str, ...] = ()) -> bool:
    """Whether `path`, which is no local file or directory, is to be looked up on the hub: it has the form of a
    repository id, does not end in one of `file_suffixes` (a missing local file, not a name), and its namespace is
    no local directory (`artifacts/model` with `artifacts/` present is a missing local path)."""
    if not HUB_NAME.match(path) or path.endswith(file_suffixes):
        return False
    namespace = path.split("/", maxsplit=1)[0] if "/" in path else None
    return namespace is None or not Path(namespace).is_dir()


def local_dir(path: str, repo_type: RepoType = "model", revision: str | None = None, weights: bool = True) -> str:
    """`path` itself when it is a local directory (or anything but a hub name: the loader reports it), else the
    directory of the hub snapshot it names, resolved through the hub cache (see the module docstring).

    For a model, `weights=False` fetches only the config and tokenizer files (preflight, the driver's tokenizer);
    a later call with weights adds the rest to the same snapshot.
    """
    if Path(path).expanduser().exists() or not is_hub_name(path):
        return path
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    no_hub = offline(repo_type)
    try:
        return _snapshot(path, repo_type, revision, weights, str(hub_cache()), no_hub)
    except (LocalEntryNotFoundError, HfHubHTTPError, HFValidationError) as err:
        raise HubError(_unresolved(path, repo_type, revision, no_hub, err)) from err


@functools.cache
def _snapshot(name: str, repo_type: RepoType, revision: str | None, weights: bool, cache: str, no_hub: bool) -> str:
    """The snapshot directory, once per process for each argument set: online, every call would ask the hub again
    (a model's roles resolve it several times: tokenizer, weights, engine)."""
    from huggingface_hub import snapshot_download

    model = repo_type == "model"
    return snapshot_download(name, repo_type=repo_type, revision=revision, cache_dir=cache, local_files_only=no_hub,
                             allow_patterns=MODEL_METADATA if model and not weights else None,
                             ignore_patterns=UNUSED_WEIGHTS if model and weights else None)


def _unresolved(path: str, repo_type: RepoType, revision: str | None, no_hub: bool, err: Exception) -> str:
    where = Path(path) if Path(path).is_absolute() else Path.cwd() / path
    kind = "data set" if repo_type == "dataset" else "model"
    at = f" at revision {revision}" if revision else ""
    if no_hub:
        switch = "HF_HUB_OFFLINE" if os.environ.get("HF_HUB_OFFLINE", "").upper() in TRUE else "HF_DATASETS_OFFLINE"
        why = f"not in the Hugging Face cache {hub_cache()} and {switch} is set"
    else:
        why = f"not in the Hugging Face cache {hub_cache()}, and the hub did not serve it ({_one_line(err)})"
    download = "hf download" + (" --repo-type dataset" if repo_type == "dataset" else "") + f" {path}"
    download += f" --revision {revision}" if revision else ""
    return (f"{path} is no local path ({where} does not exist) and the {kind} {path}{at} is {why}; "
            f"pre-download it where the hub is reachable with `{download}` (older huggingface_hub: "
            f"`huggingface-cli download ...`) into that cache, or point HF_HOME / HF_HUB_CACHE at a cache that "
            f"holds it")


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())[:300]
