"""Checkpoint layout: RUN_DIR/checkpoints/step_NNNNNN/ holds

    policy/                     the policy learners' part (`write_trainer`)
      model/                    the policy in HF format with its tokenizer, loadable by transformers and vLLM, in
                                the rollout dtype (`rollout.dtype`: what the engines served; bfloat16 by default)
      adapter/                  instead, with learner.lora: the adapters in PEFT's format (adapter_config.json,
                                adapter_model.safetensors); `distrl export --merge` makes an HF model of them
      trainer_state.safetensors the optimizer's tensors (Adam moments, step counts), keyed by their place in the
                                state, and a replica's float32 weights (a sharded part keeps them in shards/)
      trainer_state.json        the rest of the optimizer and scheduler state and the trainer's counters
    critic/                     the critic's part, the same way, when the run trains one
    driver_state.json           the driver's state (step, data iterator position)
    manifest.json               every other file's size and SHA-256, and the parts, written last

No file is a pickle, so loading a checkpoint cannot run code that someone put in it: state dicts are split into
their tensors (safetensors) and a JSON tree in which each tensor is replaced by its key.

A checkpoint is complete or absent. The driver makes a temporary sibling (`begin`), each trainer writes its part
into it, flushes every file to disk and returns the files it wrote with their sizes and SHA-256 (`write_trainer`,
`describe`: computed where they were written, by each writer for its own files), and the driver writes its own
state and the manifest from those lists, listing no directory and reading no file the trainers wrote, and only
then renames the directory into place (`finish`); the run directory is storage the driver and every learner share
(the driver checks it before the first step). On resume the driver takes
the newest checkpoint whose files match their manifest (`newest_usable`), naming each newer one it refuses and
why (a missing, truncated or altered file), and every learner reads it on its own: with learners on several nodes,
`run.output_dir` must be storage they all see. `prune` keeps the newest `run.keep_checkpoints`.

torch and safetensors are imported by the functions that need them: `distrl validate` uses `latest` without them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

PREFIX = "step_"
TRAINER_STATE = "trainer_state"
FORMAT = 2
MANIFEST = "manifest.json"
FileList = dict[str, dict[str, Any]]
"""Files a writer wrote: path relative to its part's directory -> {"bytes": size, "sha256": hex digest}."""
# Markers of the JSON tree for what JSON cannot say itself; a plain object never has exactly one of these keys.
TENSOR, TUPLE, INT_KEYS = "__tensor__", "__tuple__", "__int_keys__"


def path_for(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"{PREFIX}{step:06d}"


def step_of(path: Path) -> int:
    return int(path.name[len(PREFIX):])


def all_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint directories by step, oldest first (a step past 999999 has more digits; temporary
    directories of an interrupted save and damaged ones set aside are excluded)."""
    found = [p for p in (run_dir / "checkpoints").glob(f"{PREFIX}*") if p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=step_of)


def latest(run_dir: Path) -> Path | None:
    """The newest checkpoint directory, usable or not (see `newest_usable`)."""
    found = all_checkpoints(run_dir)
    return found[-1] if found else None


def newest_usable(run_dir: Path, checksums: bool = True) -> tuple[Path | None, list[str]]:
    """The newest checkpoint that `problem` finds nothing wrong with (None if there is none), and why each newer
    one was refused. `checksums=False` checks only that every file is there with its size (no file is read)."""
    refused: list[str] = []
    for path in reversed(all_checkpoints(run_dir)):
        unusable = problem(path, checksums)
        if unusable is None:
            return path, refused
        refused.append(unusable)
    return None, refused


def resume_point(run_dir: Path) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from (`newest_usable`, checksums read) and why each newer one was refused. Each
    refused one is renamed NAME.damaged: kept for inspection, but never loaded, pruned or mistaken for the resumed
    run's own save of that step."""
    found, refused = newest_usable(run_dir)
    for path in all_checkpoints(run_dir):
        if found is None or step_of(path) > step_of(found):
            aside = path.with_name(f"{path.name}.damaged")
            if aside.exists():  # the same step was set aside before
                aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}")
            path.rename(aside)
    return found, refused


def prune(run_dir: Path, keep: int | None) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (None keeps all) and what interrupted saves left; returns the
    deleted directories. A checkpoint a resume could fall back to is only deleted once `keep` newer ones exist."""
    found = all_checkpoints(run_dir)
    doomed = found[: -keep] if keep else []
    doomed += sorted((run_dir / "checkpoints").glob(f"{PREFIX}*.tmp"))
    for path in doomed:
        shutil.rmtree(path)
    return doomed


def driver_state(path: Path) -> dict:
    """The driver's state saved with a checkpoint: at least `step`."""
    return json.loads((path / "driver_state.json").read_text())


# ------------------------------------------------------------------------------------------------- whole checkpoint
def begin(directory: str | Path) -> Path:
    """An empty temporary sibling of checkpoint `directory` for the trainers to write their parts into (`finish`
    makes it the checkpoint). The driver calls it; the run directory is shared with every learner."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def write_trainer(directory: str | Path, model, trainer_state: dict, model_dir: str = "model") -> FileList:
    """One trained model's part of a checkpoint, in `directory` (e.g. TMP/policy): `model` saved with its
    `save_pretrained` under `model_dir` (HF format under model/, e.g. `distrl.workers.weights.hf_export.HFCopy`'s; a
    peft model's adapters in PEFT's format under adapter/; None: no HF copy), and `trainer_state` (`save_state`). Every
    file is flushed to disk before this returns, on the writer's node; returns them (`describe`). The model's folder
    is this writer's alone, so it is listed to find what was written there."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if model is not None:
        model.save_pretrained(path / model_dir, safe_serialization=True)
        written += sorted(p for p in (path / model_dir).rglob("*") if p.is_file())
    written += save_state(trainer_state, path, TRAINER_STATE)
    return describe(path, written)


def describe(root: str | Path, files: Iterable[Path]) -> FileList:
    """The manifest entries of `files` (written by this process, under `root`): size and SHA-256 of each, keyed by
    its path relative to `root`, each flushed to disk first."""
    out: FileList = {}
    for file in files:
        _fsync(file)
        out[file.relative_to(root).as_posix()] = {"bytes": file.stat().st_size, "sha256": _sha256(file)}
    return out


def finish(tmp: Path, driver: dict, parts: dict[str, list[FileList]]) -> Path:
    """Complete the checkpoint in `tmp` (`begin`) whose `parts` (`write_trainer` directories, e.g. `policy`) were
    written there, each given with its writers' file lists (every learner's answer: `FileList`s, some empty): write
    `driver` (JSON) and the manifest of those files, then rename it into place. Returns the checkpoint directory."""
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    (tmp / "driver_state.json").write_text(json.dumps(driver))
    # Data on disk before the manifest, and the manifest before the rename: a crash at any point leaves either the
    # previous checkpoint or this one complete, never a directory that looks complete and is not.
    files = describe(tmp, [tmp / "driver_state.json"])
    for part, lists in parts.items():
        for written in lists:
            files.update({f"{part}/{name}": entry for name, entry in written.items()})
    missing = [f"{part}/{TRAINER_STATE}.json" for part in parts if f"{part}/{TRAINER_STATE}.json" not in files]
    if missing:
        raise RuntimeError(f"checkpoint {final}: {', '.join(missing)} was not written")
    manifest = {"format": FORMAT, "parts": list(parts), "files": dict(sorted(files.items()))}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    _fsync(tmp / MANIFEST)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync(final.parent)
    return final


def write(directory: str | Path, parts: dict[str, tuple[Any, dict]], driver: dict) -> Path:
    """`begin`, `write_trainer` for each part (name -> (model or None, trainer_state)), `finish`: a checkpoint written
    by one process."""
    tmp = begin(directory)
    return finish(tmp, driver, {name: [write_trainer(tmp / name, model, state)]
                                for name, (model, state) in parts.items()})


def seen_digest(path: str | Path) -> str | None:
    """SHA-256 of the file at `path` as this process's node sees it, None if it has none there. Learner 0 writes
    the checkpoints and the driver reads them: the driver compares this digest of a file it wrote in the run
    directory with its own to show they share the storage."""
    return _sha256(Path(path)) if Path(path).is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_model(directory: str | Path, model) -> None:
    """Load the HF weights a part of a checkpoint holds (`write_trainer`'s model/) into `model`, which must have
    exactly the same parameters."""
    from safetensors.torch import load_file

    path = Path(directory)
    state = {}
    for shard in sorted((path / "model").glob("*.safetensors")):
        state.update(load_file(shard))
    missing, unexpected = model.load_state_dict(state, strict=False)
    # save_pretrained leaves out lm_head only when it *is* the embedding matrix; anything else missing is an error.
    output = model.get_output_embeddings()  # None for a value model (its head is not an LM head)
    tied = output is not None and output.weight is model.get_input_embeddings().weight
    missing = [k for k in missing if not (tied and k.startswith("lm_head."))]
    if unexpected or missing:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {sorted(missing)}, "
                           f"unexpected {sorted(unexpected)}")


def problem(directory: str | Path, checksums: bool = True) -> str | None:
    """Why the checkpoint in `directory` cannot be loaded, naming the file; None if every file its manifest lists
    is there with its size (and, with `checksums`, its SHA-256)."""
    path = Path(directory)
    if (path / "learner_state.pt").exists():
        return (f"checkpoint {path} holds learner_state.pt, a pickle written by an older distrl; it is not loaded "
                f"because unpickling can run code. Start afresh (run.overwrite=true, run.resume=false) or resume "
                f"from a checkpoint written by this version")
    files = _manifest(path)
    if isinstance(files, str):
        return f"checkpoint {path}: {files}"
    if not files:
        return (f"checkpoint {path} was written by an older distrl (one learner's files at the top, format 1); it "
                f"cannot be resumed by this version. Start afresh (run.overwrite=true, run.resume=false)")
    for name, expected in files.items():
        wrong = _file_problem(path / name, expected, checksums)
        if wrong:
            return f"checkpoint {path}: {name} {wrong}"
    return None


def _manifest(path: Path) -> dict[str, dict] | str:
    """The manifest's files (name -> bytes, sha256; empty for an older format), or what is wrong with it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files, fmt = manifest["files"], manifest.get("format")
    except FileNotFoundError:
        return f"has no {MANIFEST}: it was not completely written (or was written by an older distrl)"
    except (ValueError, KeyError, TypeError, AttributeError):
        return f"{MANIFEST} is damaged (not the JSON that distrl writes)"
    if fmt != FORMAT:
        return {}
    needed = ["driver_state.json", *(f"{part}/{TRAINER_STATE}.{ext}" for part in manifest.get("parts", [])
                                     for ext in ("json", "safetensors"))]
    missing = [n for n in needed if n not in files]
    return f"{MANIFEST} does not list {', '.join(missing)}" if missing else files


def _file_problem(file: Path, expected: dict, checksums: bool) -> str | None:
    if not file.is_file():
        return "is missing"
    size = file.stat().st_size
    if size != expected["bytes"]:
        return f"has {size} bytes, the manifest says {expected['bytes']} (truncated?)"
    if checksums and _sha256(file) != expected["sha256"]:
        return "does not match its SHA-256 in the manifest (the file was altered)"
    return None


def load_trainer_state(directory: str | Path) -> dict:
    """The `trainer_state` that `write_trainer` saved in the part `directory` of a checkpoint, tensors on CPU. The
    files' sizes are checked against the manifest here; their checksums were checked by the driver when it chose the
    checkpoint (`newest_usable`)."""
    part = Path(directory)
    unusable = problem(part.parent, checksums=False)
    if unusable:
        raise RuntimeError(unusable)
    return load_state(part, TRAINER_STATE)


# ----------------------------------------------------------------------------------------------- state dicts
def save_state(state: dict, directory: Path, name: str) -> list[Path]:
    """Write a state dict as NAME.safetensors (its tensors, under keys such as `optimizer.state.0.exp_avg`) and
    NAME.json (everything else, each tensor replaced by its key); returns the two files.

    `state` may nest dicts (string or integer keys), lists and tuples of tensors, numbers, strings, booleans and
    None, which is what torch optimizers and LR schedulers return; anything else is a TypeError.
    """
    from safetensors.torch import save_file

    tensors: dict[str, Any] = {}
    tree = _encode(state, (), tensors)
    save_file(tensors, directory / f"{name}.safetensors")
    (directory / f"{name}.json").write_text(json.dumps(tree, indent=1))
    return [directory / f"{name}.safetensors", directory / f"{name}.json"]


def load_state(directory: Path, name: str) -> dict:
    """The state dict `save_state` wrote, tensors on CPU (`load_state_dict` moves them where the model is)."""
    from safetensors.torch import load_file

    tensors = load_file(directory / f"{name}.safetensors", device="cpu")
    return _decode(json.loads((directory / f"{name}.json").read_text()), tensors)


def _encode(value: Any, path: tuple[str, ...], tensors: dict[str, Any]) -> Any:
    import torch

    where = ".".join(path) or "the state"
    if isinstance(value, torch.Tensor):
        key = ".".join(path)
        if key in tensors:  # string keys with dots could spell another tensor's path
            raise TypeError(f"{where}: two tensors would be saved under the same key {key!r}")
        tensors[key] = value.detach().to("cpu").contiguous()
        return {TENSOR: key}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        items = [_encode(v, (*path, str(i)), tensors) for i, v in enumerate(value)]
        return {TUPLE: items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            if len(value) == 1 and next(iter(value)) in (TENSOR, TUPLE, INT_KEYS):
                raise TypeError(f"{where}: the key {next(iter(value))!r} is reserved by the checkpoint format")
            return {k: _encode(v, (*path, k), tensors) for k, v in value.items()}
        if all(isinstance(k, int) and not isinstance(k, bool) for k in value):
            return {INT_KEYS: {str(k): _encode(v, (*path, str(k)), tensors) for k, v in value.items()}}
        raise TypeError(f"{where}: a dict's keys must be all strings or all integers, got {sorted(map(repr, value))}")
    raise TypeError(f"{where}: a {type(value).__name__} cannot be saved without pickle")


def _decode(tree: Any, tensors: dict[str, Any]) -> Any:
    if isinstance(tree, list):
        return [_decode(v, tensors) for v in tree]
    if not isinstance(tree, dict):
        return tree
    if len(tree) == 1:
        ((tag, inner),) = tree.items()
        if tag == TENSOR:
            return tensors[inner]
        if tag == TUPLE:
            return tuple(_decode(v, tensors) for v in inner)
        if tag == INT_KEYS:
            return {int(k): _decode(v, tensors) for k, v in inner.items()}
    return {k: _decode(v, tensors) for k, v in tree.items()}
