"""Writing a prompt file and loading it, for the prompt-data tests."""

from __future__ import annotations

import json
from pathlib import Path

from distrl.config import DataConfig
from distrl.data.prompts import load_prompts


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def load(path, tokenizer, **kwargs):
    return load_prompts(DataConfig(path=str(path), **kwargs), tokenizer)
