"""Prompt datasets: rows -> tokenized `Prompt`s, and the deterministic, resumable prompt stream.

A source is read as `datasets.load_dataset` reads it (`distrl.data.read_rows`: files, globs, directories, hub names
through the Hugging Face cache), except JSON lines, which are read line by line: each row exactly as written (no
schema unified across rows, no missing key filled with null) and each error at its `file:line`. `data.prompt` takes
a column or a template over columns; `data.reward_columns` picks what the reward sees.

Light at import time: `datasets`, huggingface_hub, jinja2 and `distrl.types.prompt` are imported by the
functions that need them, so `distrl validate` never pays for them.
"""

from __future__ import annotations

import glob
import json
import random
import string
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrl.config import DataConfig
from distrl.config.model import template_fields
from distrl.hub import HubError, datasets_cache, is_hub_name, local_dir

if TYPE_CHECKING:
    from distrl.types.prompt import Prompt

__all__ = ["DataError", "DataStats", "PromptStream", "check_rows", "load_prompts", "read_rows"]

JSON_LINES = (".jsonl", ".json")
BUILDERS = {".parquet": "parquet", ".csv": "csv"}
"""`datasets`' builder of each file format read through `load_dataset` (JSON lines are read line by line)."""
FILE_SUFFIXES = (*JSON_LINES, *BUILDERS)
GLOB_CHARS = ("*", "?", "[")
SAVED = ("dataset_dict.json", "state.json")  # what `save_to_disk` writes at the top of a DatasetDict / Dataset
RENDERED_IN_CHECK = 16  # prompts the preflight renders with the chat template: enough to meet each row shape


class DataError(ValueError):
    """A prompt dataset is unusable; the message names the file and the line (or row) at fault, `field` the config
    field to change."""

    def __init__(self, message: str, field: str = "data.path"):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class DataStats:
    """What loading did: `rows` read, `kept` as prompts, `dropped` for exceeding `data.max_prompt_tokens`,
    `longest` kept prompt in tokens."""

    rows: int
    kept: int
    dropped: int
    longest: int


# -------------------------------------------------------------------------------------------------------- reading
def read_rows(cfg: DataConfig) -> Iterator[tuple[str, Any]]:
    """The rows of the split `cfg` names, each with its location for error messages: `file:line` (1-based) in
    JSON-lines files, else `file: row i` or `source split: row i` (0-based).

    `cfg.path` is, in this order: a local file; a local directory (saved with `save_to_disk`, else in the hub's
    layout); a glob of local files; a hub name, resolved through the Hugging Face cache (`distrl.hub`).
    """
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


# ------------------------------------------------------------------------------------------------------ rendering
def _check_messages(messages: list, where: str, key: str) -> None:
    if not messages:
        raise DataError(f"{where}: {key!r} is an empty list of chat messages")
    for j, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(f"{where}: {key!r} message {j} must be an object with string 'role' and 'content', "
                            f"got {str(message)[:100]}")


def _apply_template(tokenizer, messages: list[dict], where: str, mode: str) -> str:
    from jinja2 import TemplateError

    if tokenizer.chat_template is None:
        raise DataError(f"{where}: this prompt needs a chat template (data.chat_template {mode!r}, or "
                        f"data.system_prompt) and the tokenizer has none; use plain-string prompts with "
                        f"data.chat_template 'auto' or 'never'")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as err:
        raise DataError(f"{where}: the chat template rejected these messages: {err}") from err


CONVERSIONS: dict[str, Callable[[Any], str]] = {"r": repr, "s": str, "a": ascii}  # str.format's `!r`, `!s`, `!a`


class PromptSpec:
    """`data.prompt` parsed once: a column, or a template over columns; and what every row's prompt becomes."""

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg
        self.template = None if template_fields(cfg.prompt) is None else list(string.Formatter().parse(cfg.prompt))

    def prompt(self, row: Any, where: str) -> str | list[dict]:
        """One row's prompt, checked: the text to use as it is, or the chat messages to render (per
        `data.chat_template` and `data.system_prompt`)."""
        cfg = self.cfg
        if not isinstance(row, dict):
            what = "the columns of data.prompt" if self.template else f"a {cfg.prompt!r} field"
            raise DataError(f"{where}: expected an object with {what}, got {type(row).__name__}")
        prompt = self._column(row, where) if self.template is None else self._fill(row, where)
        if cfg.system_prompt is not None:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            if messages[0]["role"] == "system":
                return messages
            return [{"role": "system", "content": cfg.system_prompt}, *messages]
        if isinstance(prompt, str):
            return prompt if cfg.chat_template != "always" else [{"role": "user", "content": prompt}]
        return prompt

    def _column(self, row: dict, where: str) -> str | list[dict]:
        key, mode = self.cfg.prompt, self.cfg.chat_template
        if key not in row:
            raise DataError(f"{where}: no prompt field {key!r} (data.prompt); the row has {sorted(row)}",
                            "data.prompt")
        prompt = row[key]
        if isinstance(prompt, str):
            if not prompt:
                raise DataError(f"{where}: {key!r} is empty")
            return prompt
        if isinstance(prompt, list):
            if mode == "never":
                raise DataError(f"{where}: {key!r} holds chat messages but data.chat_template is 'never'")
            _check_messages(prompt, where, key)
            return prompt
        raise DataError(f"{where}: {key!r} must be a string or a list of chat messages, got {type(prompt).__name__}")

    def _fill(self, row: dict, where: str) -> str:
        """The template of `data.prompt` with each `{column}` replaced by the row's value (str.format's rules for
        conversions and format specs)."""
        assert self.template is not None
        out = []
        for literal, name, spec, conversion in self.template:
            out.append(literal)
            if name is None:
                continue
            if name not in row:
                raise DataError(f"{where}: the template data.prompt names the column {name!r}, which the row lacks; "
                                f"the row has {sorted(row)}", "data.prompt")
            value = row[name]
            if not isinstance(value, (str, int, float)):
                raise DataError(f"{where}: column {name!r} of the template data.prompt must hold a string or a "
                                f"number, got {type(value).__name__}", "data.prompt")
            try:
                value = CONVERSIONS[conversion](value) if conversion else value
                out.append(format(value, spec or ""))
            except (KeyError, ValueError) as err:
                raise DataError(f"{where}: the template data.prompt cannot format column {name!r} "
                                f"({value!r}) with {{{name}{'!' + conversion if conversion else ''}:{spec}}}: "
                                f"{err}", "data.prompt") from None
        text = "".join(out)
        if not text:
            raise DataError(f"{where}: the template data.prompt renders an empty prompt", "data.prompt")
        return text


def _render(prompt: str | list[dict], where: str, cfg: DataConfig, tokenizer) -> tuple[str, bool]:
    """(prompt text, whether the chat template rendered it) for one row's checked prompt."""
    if isinstance(prompt, str):
        return prompt, False
    return _apply_template(tokenizer, prompt, where, cfg.chat_template), True


def _sample(row: dict, where: str, columns: list[str] | None) -> dict[str, Any]:
    """What the reward receives of the row: `data.reward_columns` of it, or all of it."""
    if columns is None:
        return row
    missing = [c for c in columns if c not in row]
    if missing:
        raise DataError(f"{where}: no column {missing[0]!r} (data.reward_columns); the row has {sorted(row)}",
                        "data.reward_columns")
    return {c: row[c] for c in columns}


def _answer(row: dict, where: str, key: str | None) -> str | None:
    value = row.get(key) if key is not None else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{where}: answer field {key!r} (data.answer_key) must be a string or a number, "
                    f"got {type(value).__name__}", "data.answer_key")


def _token_ids(tokenizer, texts: list[str], templated: list[bool]) -> list[list[int]]:
    """Token ids with BOS exactly once.

    A rendered chat template already writes its special tokens (HF tokenizes it with add_special_tokens=False
    too), as does a plain prompt that starts with BOS; every other plain prompt gets the tokenizer's own.
    """
    bos = tokenizer.bos_token
    add = [not t and not (bos and text.startswith(bos)) for text, t in zip(texts, templated, strict=True)]
    ids: list[list[int]] = [[] for _ in texts]
    for flag in (True, False):
        idx = [i for i, a in enumerate(add) if a == flag]
        if idx:  # one batched call per setting: much faster than a call per row on large datasets
            encoded = tokenizer([texts[i] for i in idx], add_special_tokens=flag)["input_ids"]
            for i, row_ids in zip(idx, encoded, strict=True):
                ids[i] = list(row_ids)
    return ids


# -------------------------------------------------------------------------------------------------------- loading
def _checked_rows(cfg: DataConfig) -> Iterator[tuple[str, str | list[dict], str | None, dict[str, Any]]]:
    """(location, prompt before the chat template, answer, what the reward receives) of every row, checked."""
    spec = PromptSpec(cfg)
    for where, row in read_rows(cfg):
        prompt = spec.prompt(row, where)
        yield where, prompt, _answer(row, where, cfg.answer_key), _sample(row, where, cfg.reward_columns)


def load_prompts(cfg: DataConfig, tokenizer) -> tuple[list[Prompt], DataStats]:
    """Read, render and tokenize the prompts `cfg` names; drop (and count) those over `cfg.max_prompt_tokens`.

    Raises DataError naming file and line (or row) for a malformed row, and when no prompt is left.
    """
    from distrl.types.prompt import Prompt

    samples, texts, templated, answers = [], [], [], []
    for where, prompt, answer, sample in _checked_rows(cfg):
        text, from_template = _render(prompt, where, cfg, tokenizer)
        answers.append(answer)
        samples.append(sample)
        texts.append(text)
        templated.append(from_template)
    token_ids = _token_ids(tokenizer, texts, templated)
    prompts = [Prompt(index=i, text=texts[i], prompt_ids=token_ids[i], answer=answers[i], sample=samples[i])
               for i in range(len(samples)) if len(token_ids[i]) <= cfg.max_prompt_tokens]
    stats = DataStats(rows=len(samples), kept=len(prompts), dropped=len(samples) - len(prompts),
                      longest=max((len(p.prompt_ids) for p in prompts), default=0))
    if not prompts:
        raise DataError(f"{cfg.path}: no prompts left: {stats.rows} rows read, {stats.dropped} longer than "
                        f"data.max_prompt_tokens ({cfg.max_prompt_tokens})")
    return prompts, stats


def check_rows(cfg: DataConfig, tokenizer=None, rendered: int = RENDERED_IN_CHECK) -> tuple[int, bool]:
    """Read every row `cfg` names and check it as `load_prompts` would, short of tokenizing: (rows read, whether
    some prompt needs the tokenizer's chat template). With a `tokenizer` that has a chat template, the first
    `rendered` prompts that need it are rendered too (a template may refuse a role, e.g. `data.system_prompt`'s).

    Raises DataError naming file and line (or row) for the first malformed row, and for a source with no rows.
    """
    rows, needs_template = 0, 0
    for where, prompt, _, _ in _checked_rows(cfg):
        if not isinstance(prompt, str):
            needs_template += 1
            if tokenizer is not None and tokenizer.chat_template is not None and needs_template <= rendered:
                _apply_template(tokenizer, prompt, where, cfg.chat_template)
        rows += 1
    if not rows:
        raise DataError(f"{cfg.path} holds no rows")
    return rows, needs_template > 0


def _relative_note(path: str) -> str:
    return "" if Path(path).is_absolute() else f" (relative to the working directory {Path.cwd()})"


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())


# --------------------------------------------------------------------------------------------------------- stream
class PromptStream:
    """The endless stream of prompts, epoch after epoch; every draw is identified by its ticket (its position in
    the stream).

    Ticket t is prompt `order_e[t mod N]` of epoch `e = t // N`, where epoch e visits every prompt once in the order
    `random.Random(seed * 1_000_003 + e)` shuffles them to (dataset order without `shuffle`): the stream depends
    only on (prompts, seed, shuffle). Draws may run ahead of training (asynchronous mode, dynamic sampling), so
    the state records what was *consumed* (trained on, or discarded by dynamic sampling or the staleness bound):
    a restored stream serves again exactly the prompts drawn but not consumed, and nothing consumed.
    """

    def __init__(self, prompts: list[Prompt], seed: int = 0, shuffle: bool = True):
        if not prompts:
            raise ValueError("PromptStream needs at least one prompt")
        self.prompts, self.seed, self.shuffle = list(prompts), seed, shuffle
        self._orders: dict[int, list[int]] = {}
        self._draw = 0  # next ticket to hand out
        self._low = 0  # every ticket below it is consumed
        self._consumed: set[int] = set()  # consumed tickets >= _low

    def epoch_of(self, ticket: int) -> int:
        return ticket // len(self.prompts)

    def prompt(self, ticket: int) -> Prompt:
        epoch = self.epoch_of(ticket)
        if epoch not in self._orders:
            order = list(range(len(self.prompts)))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # tickets are drawn in order: one epoch's order at a time suffices
        return self.prompts[self._orders[epoch][ticket % len(self.prompts)]]

    def take(self, n: int) -> list[tuple[int, Prompt]]:
        """The next `n` (ticket, prompt) pairs, skipping tickets a restored state marks as consumed."""
        out: list[tuple[int, Prompt]] = []
        while len(out) < n:
            ticket, self._draw = self._draw, self._draw + 1
            if ticket not in self._consumed:
                out.append((ticket, self.prompt(ticket)))
        return out

    def consume(self, tickets: Iterable[int]) -> None:
        """Mark drawn tickets as consumed (trained on or discarded)."""
        self._consumed.update(t for t in tickets if t >= self._low)
        while self._low in self._consumed:
            self._consumed.remove(self._low)
            self._low += 1

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the first unconsumed ticket, the consumed tickets beyond it, the dataset size."""
        return {"next": self._low, "consumed": sorted(self._consumed), "num_prompts": len(self.prompts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict()`: draws restart at the first unconsumed ticket. The dataset must have the
        same number of prompts."""
        if state["num_prompts"] != len(self.prompts):
            raise ValueError(f"cannot resume the prompt stream: the checkpoint saw {state['num_prompts']} prompts, "
                             f"the dataset now has {len(self.prompts)}")
        self._low = self._draw = int(state["next"])
        self._consumed = {int(t) for t in state["consumed"]}
