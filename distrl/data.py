"""Prompt datasets: rows -> tokenized `Prompt`s, and the deterministic, resumable prompt stream.

Light at import time: pyarrow, `datasets`, jinja2 and `distrl.types` (which imports torch) are imported by the
functions that need them, so `distrl validate` never pays for them.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrl.config import DataConfig

if TYPE_CHECKING:
    from distrl.types import Prompt

__all__ = ["DataError", "DataStats", "PromptStream", "check_rows", "load_prompts", "read_rows"]

JSON_LINES = (".jsonl", ".json")


class DataError(ValueError):
    """A prompt dataset is unusable; the message names the file and the line (or row) at fault."""


@dataclass(frozen=True)
class DataStats:
    """What loading did: `rows` read, `kept` as prompts, `dropped` for exceeding `data.max_prompt_tokens`,
    `longest` kept prompt in tokens."""

    rows: int
    kept: int
    dropped: int
    longest: int


# -------------------------------------------------------------------------------------------------------- reading
def _json_lines(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
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


def _parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except pa.ArrowException as err:
        raise DataError(f"{path}: cannot read as parquet: {err}") from err
    for i, row in enumerate(table.to_pylist()):
        yield f"{path}: row {i}", row


def _saved_dataset(path: Path) -> Iterator[tuple[str, Any]]:
    import datasets

    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise DataError(f"{path}: not a dataset saved with `save_to_disk`: {err}") from err
    if isinstance(ds, datasets.DatasetDict):
        if len(ds) != 1:
            raise DataError(f"{path} holds the splits {sorted(ds)}: point data.path at one of their directories, "
                            f"e.g. {path / sorted(ds)[0]}")
        (ds,) = ds.values()
    for i, row in enumerate(ds):
        yield f"{path}: row {i}", row


def read_rows(path: str | Path) -> Iterator[tuple[str, Any]]:
    """Rows of a `.jsonl` / `.json` (JSON lines), `.parquet` or `save_to_disk` dataset, each with its location
    (`file:line`, 1-based, or `file: row i`, 0-based) for error messages."""
    path = Path(path)
    if path.is_dir():
        return _saved_dataset(path)
    if not path.is_file():
        raise DataError(f"{path} does not exist")
    if path.suffix in JSON_LINES:
        return _json_lines(path)
    if path.suffix == ".parquet":
        return _parquet(path)
    raise DataError(f"{path}: unknown format {path.suffix!r}; expected .jsonl, .json (JSON lines), "
                    f".parquet, or a directory saved with datasets' `save_to_disk`")


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
        raise DataError(f"{where}: this prompt needs a chat template (data.chat_template {mode!r}) and the "
                        f"tokenizer has none; use plain-string prompts with data.chat_template 'auto' or 'never'")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TemplateError as err:
        raise DataError(f"{where}: the chat template rejected these messages: {err}") from err


def _prompt(row: Any, where: str, cfg: DataConfig) -> str | list[dict]:
    """One row's prompt, checked: the text to use as it is, or the chat messages to render (per
    `cfg.chat_template`)."""
    key, mode = cfg.prompt_key, cfg.chat_template
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with a {key!r} field, got {type(row).__name__}")
    if key not in row:
        raise DataError(f"{where}: no prompt field {key!r} (data.prompt_key); the row has {sorted(row)}")
    prompt = row[key]
    if isinstance(prompt, str):
        if not prompt:
            raise DataError(f"{where}: {key!r} is empty")
        return prompt if mode != "always" else [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        if mode == "never":
            raise DataError(f"{where}: {key!r} holds chat messages but data.chat_template is 'never'")
        _check_messages(prompt, where, key)
        return prompt
    raise DataError(f"{where}: {key!r} must be a string or a list of chat messages, got {type(prompt).__name__}")


def _render(row: Any, where: str, cfg: DataConfig, tokenizer) -> tuple[str, bool]:
    """(prompt text, whether the chat template rendered it) for one row."""
    prompt = _prompt(row, where, cfg)
    if isinstance(prompt, str):
        return prompt, False
    return _apply_template(tokenizer, prompt, where, cfg.chat_template), True


def _answer(row: dict, where: str, key: str | None) -> str | None:
    value = row.get(key) if key is not None else None
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"{where}: answer field {key!r} (data.answer_key) must be a string or a number, "
                    f"got {type(value).__name__}")


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
def load_prompts(cfg: DataConfig, tokenizer) -> tuple[list[Prompt], DataStats]:
    """Read, render and tokenize the prompts `cfg` names; drop (and count) those over `cfg.max_prompt_tokens`.

    Raises DataError naming file and line (or row) for a malformed row, and when no prompt is left.
    """
    from distrl.types import Prompt

    rows, texts, templated, answers = [], [], [], []
    for where, row in read_rows(cfg.path):
        text, from_template = _render(row, where, cfg, tokenizer)
        answers.append(_answer(row, where, cfg.answer_key))
        rows.append(row)
        texts.append(text)
        templated.append(from_template)
    token_ids = _token_ids(tokenizer, texts, templated)
    prompts = [Prompt(index=i, text=texts[i], prompt_ids=token_ids[i], answer=answers[i], sample=rows[i])
               for i in range(len(rows)) if len(token_ids[i]) <= cfg.max_prompt_tokens]
    stats = DataStats(rows=len(rows), kept=len(prompts), dropped=len(rows) - len(prompts),
                      longest=max((len(p.prompt_ids) for p in prompts), default=0))
    if not prompts:
        raise DataError(f"{cfg.path}: no prompts left: {stats.rows} rows read, {stats.dropped} longer than "
                        f"data.max_prompt_tokens ({cfg.max_prompt_tokens})")
    return prompts, stats


def check_rows(cfg: DataConfig) -> tuple[int, bool]:
    """Read every row `cfg` names and check it as `load_prompts` would, short of rendering and tokenizing (which
    need the tokenizer): (rows read, whether some prompt needs the tokenizer's chat template).

    Raises DataError naming file and line (or row) for the first malformed row, and for a file with no rows.
    """
    rows, needs_template = 0, False
    for where, row in read_rows(cfg.path):
        needs_template |= not isinstance(_prompt(row, where, cfg), str)
        _answer(row, where, cfg.answer_key)
        rows += 1
    if not rows:
        raise DataError(f"{cfg.path} holds no rows")
    return rows, needs_template


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
