"""Where prompt rows come from: `read_rows` reads the source `data.path` names, each row with its location.

A source is read as `datasets.load_dataset` reads it (files, globs, directories, hub names through the Hugging Face
cache), except JSON lines, which are read line by line: each row exactly as written (no schema unified across rows,
no missing key filled with null) and each error at its `file:line`.

Light at import time: `datasets` and huggingface_hub are imported by the functions that need them, so `distrl
validate` never pays for them.
"""

from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from distrl.config import DataConfig
from distrl.hub import HubError, datasets_cache, is_hub_name, local_dir

__all__ = ["DataError", "read_rows"]

JSON_LINES = (".jsonl", ".json")
BUILDERS = {".parquet": "parquet", ".csv": "csv"}
"""`datasets`' builder of each file format read through `load_dataset` (JSON lines are read line by line)."""
FILE_SUFFIXES = (*JSON_LINES, *BUILDERS)
GLOB_CHARS = ("*", "?", "[")
SAVED = ("dataset_dict.json", "state.json")  # what `save_to_disk` writes at the top of a DatasetDict / Dataset


class DataError(ValueError):
    """A prompt dataset is unusable; the message names the file and the line (or row) at fault, `field` the config
    field to change."""

    def __init__(self, message: str, field: str = "data.path"):
        super().__init__(message)
        self.field = field


def read_rows(cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    """The rows of the split `cfg` names, each with its location for error messages: `file:line` (1-based) in
    JSON-lines files, else `file: row i` or `source split: row i` (0-based).

    `cfg.path` is, in this order: a local file; a local directory (saved with `save_to_disk`, else in the hub's
    layout); a glob of local files; a hub name, resolved through the Hugging Face cache (`distrl.hub`). Or
    `cfg.function` makes the rows (`function: row i`).
    """
    if cfg.function is not None:
        return _function_rows(cfg.function, cfg.kwargs)
    assert cfg.path is not None  # DataConfig holds exactly one of path and function
    path = Path(cfg.path).expanduser()
    is_glob = any(c in cfg.path for c in GLOB_CHARS)
    hub = not path.exists() and not is_glob and is_hub_name(cfg.path, FILE_SUFFIXES)
    if cfg.revision is not None and not hub:
        raise DataError(f"data.revision {cfg.revision!r} is for hub names; {cfg.path} is a local path",
                        "data.revision")
    if path.is_dir():
        if any((path / name).is_file() for name in SAVED):
            return _saved_dataset(path, cfg)
        return _dataset_dir(str(path), str(path), cfg)
    if hub:
        try:
            directory = local_dir(cfg.path, "dataset", cfg.revision)
        except HubError as err:
            raise DataError(str(err)) from err
        return _dataset_dir(directory, cfg.path, cfg)
    files = sorted(p for p in map(Path, glob.glob(str(path))) if p.is_file()) if is_glob else [path]
    if not files:
        raise DataError(f"{cfg.path} matches no file{_relative_note(cfg.path)}")
    if not files[0].exists():
        raise DataError(f"{cfg.path} does not exist{_relative_note(cfg.path)}")
    return _files(files, cfg)


def _function_rows(spec: str, kwargs: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """The rows that `data.function` makes with `data.kwargs`."""
    from distrl.imports import import_spec

    try:
        fn = import_spec(spec, "data function", "function", "distrl.standards.reasoning_gym:rows")
    except ValueError as err:
        raise DataError(str(err), "data.function") from err
    try:
        rows = fn(**kwargs)
    # The function is the user's (or a standard's generator, whose configs `assert` their bounds): what it raises
    # on its arguments is a problem with data.kwargs.
    except (TypeError, ValueError, KeyError, AssertionError, ImportError) as err:
        raise DataError(f"{spec}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) failed: "
                        f"{type(err).__name__}: {_one_line(err)}", "data.kwargs") from err
    for i, row in enumerate(rows):
        yield f"{spec}: row {i}", row


def _files(files: list[Path], cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    suffixes = sorted({f.suffix for f in files})
    unknown = [s for s in suffixes if s not in FILE_SUFFIXES]
    if unknown or (len(suffixes) > 1 and not set(suffixes) <= set(JSON_LINES)):
        raise DataError(f"{cfg.path}: {'unknown format ' + repr(unknown[0]) if unknown else 'mixed formats'}; "
                        f"expected files of one of {', '.join(FILE_SUFFIXES)}, a directory saved with datasets' "
                        f"`save_to_disk` or in the hub's layout, or a hub name")
    if cfg.subset is not None:
        raise DataError(f"data.subset {cfg.subset!r} names a configuration of a data set directory or hub name; "
                        f"{cfg.path} is files: drop it (--set data.subset=null)", "data.subset")
    if cfg.split not in (None, "train"):
        raise DataError(f"data.split {cfg.split!r}: files are one split ('train' in datasets' terms); point "
                        f"data.path at the files of split {cfg.split!r} instead", "data.split")
    for file in files:
        if file.suffix in JSON_LINES:
            yield from _json_lines(file)
        else:
            yield from _builder_rows(file)


def _json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        head = f.read(4096).lstrip()
        f.seek(0)
        if path.suffix == ".json" and head.startswith(b"["):  # one JSON array of rows, as `datasets` also reads
            yield from _json_array(path, f.read())
            return
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg}, column {err.colno}); "
                                f"expected one JSON object per line") from None
            except UnicodeDecodeError as err:
                raise DataError(f"{where}: not valid UTF-8 ({err.reason})") from None
            yield where, row


def _json_array(path: Path, text: bytes) -> Iterator[tuple[str, Any]]:
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg}, column {err.colno}); expected one JSON "
                        f"array of objects, or one JSON object per line") from None
    except UnicodeDecodeError as err:
        raise DataError(f"{path}: not valid UTF-8 ({err.reason})") from None
    for i, row in enumerate(rows):
        yield f"{path}: row {i}", row


def _builder_rows(path: Path) -> Iterator[tuple[str, Any]]:
    """A parquet or CSV file's rows, read by `datasets` (prepared once into its Arrow cache)."""
    import datasets

    try:
        ds = datasets.load_dataset(BUILDERS[path.suffix], data_files=str(path), split="train",
                                   cache_dir=str(datasets_cache()))
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as err:
        raise DataError(f"{path}: cannot read as {BUILDERS[path.suffix]}: {_one_line(err)}") from err
    for i, row in enumerate(ds):
        yield f"{path}: row {i}", row


def _saved_dataset(path: Path, cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    import datasets

    if cfg.subset is not None:
        raise DataError(f"data.subset {cfg.subset!r}: {path} was saved with `save_to_disk`, which keeps no "
                        f"configurations", "data.subset")
    ds = datasets.load_from_disk(str(path))
    where = str(path)
    if isinstance(ds, datasets.DatasetDict):
        split = _split(sorted(ds), cfg, where)
        ds, where = ds[split], f"{path} {split}"
    elif cfg.split is not None:
        raise DataError(f"data.split {cfg.split!r}: {path} holds one dataset without splits; remove data.split",
                        "data.split")
    for i, row in enumerate(ds):
        yield f"{where}: row {i}", row


def _dataset_dir(directory: str, shown: str, cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    """The rows of a directory in the hub's layout (a resolved hub name's snapshot, `shown` as that name)."""
    import datasets

    try:
        splits = datasets.load_dataset(directory, cfg.subset, cache_dir=str(datasets_cache()))
    except ValueError as err:  # no such configuration, or one is needed: datasets lists the configurations
        field = "data.subset" if "config" in str(err).lower() else "data.path"
        raise DataError(f"{shown}: {_one_line(err)}", field) from err
    except (OSError, datasets.exceptions.DatasetGenerationError) as err:
        raise DataError(f"{shown}: cannot read as a data set: {_one_line(err)}") from err
    split = _split(sorted(splits), cfg, shown)
    where = f"{shown} {cfg.subset + '/' if cfg.subset else ''}{split}"
    for i, row in enumerate(splits[split]):
        yield f"{where}: row {i}", row


def _split(names: list[str], cfg: DataConfig, shown: str) -> str:
    """`data.split`, else the only split, else `train`."""
    if cfg.split is not None:
        if cfg.split not in names:
            raise DataError(f"data.split {cfg.split!r}: {shown} has the splits {names}", "data.split")
        return cfg.split
    if len(names) == 1:
        return names[0]
    if "train" in names:
        return "train"
    raise DataError(f"{shown} holds the splits {names} and none is 'train': set data.split to one of them",
                    "data.split")


def _relative_note(path: str) -> str:
    return "" if Path(path).is_absolute() else f" (relative to the working directory {Path.cwd()})"


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
