"""Rows -> tokenized `Prompt`s: `data.prompt` (a column, or a template over columns) gives each row's prompt, the
chat template (`data.chat_template`, `data.system_prompt`) renders it, `data.answer_key` and `data.reward_columns`
pick what the reward sees, and prompts over `data.max_prompt_tokens` are dropped and counted (`load_prompts`).
`check_rows` checks every row the same way without tokenizing (the preflight's check).

Light at import time: jinja2 is imported by the functions that need it; the tokenizer comes from the caller.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from distrl.config import DataConfig
from distrl.config.model import template_fields
from distrl.data.sources import DataError, read_rows
from distrl.types.prompt import Prompt

__all__ = ["DataStats", "PromptSpec", "check_rows", "load_prompts"]

RENDERED_IN_CHECK = 16  # prompts the preflight renders with the chat template: enough to meet each row shape


@dataclass(frozen=True)
class DataStats:
    """What loading did: `rows` read, `kept` as prompts, `dropped` for exceeding `data.max_prompt_tokens`,
    `longest` kept prompt in tokens."""

    rows: int
    kept: int
    dropped: int
    longest: int


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
        raise DataError(f"{cfg.source}: no prompts left: {stats.rows} rows read, {stats.dropped} longer than "
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
        raise DataError(f"{cfg.source} holds no rows")
    return rows, needs_template > 0
