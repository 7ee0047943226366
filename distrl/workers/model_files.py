"""Where a model's files are, for every role: `model.path` resolved (a hub name through the Hugging Face cache, or the
tiny test model, built when asked for), the tokenizer's directory and the tokenizer, and the dtype names of the
config."""

from __future__ import annotations

from pathlib import Path

import torch

from distrl.config import ModelConfig
from distrl.hub import local_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(cfg: ModelConfig, path: str | None = None, weights: bool = True) -> str:
    """The local directory of the model to load (`path`, else `model.path`): a hub name resolved through the
    Hugging Face cache (`distrl.hub.local_dir`; `weights=False` fetches only its config and tokenizer files), or
    the tiny test model, built first when the config asks for it and it is absent."""
    path = path or cfg.path
    if cfg.create_tiny_if_missing:
        from filelock import FileLock

        from distrl.workers.tiny_model import make_tiny_model

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # Always under the lock, even to look: config.json is the first file the build writes, so a look without
        # the lock could see it while another actor is still writing it (and read an empty file).
        with FileLock(str(Path(path)) + ".lock"):
            if not (Path(path) / "config.json").exists():
                make_tiny_model(path)
        return path
    return local_dir(path, weights=weights)


def tokenizer_path(cfg: ModelConfig) -> str:
    """The local directory of the tokenizer: `model.tokenizer`, else the model's, resolved as models are."""
    if cfg.tokenizer:
        return local_dir(cfg.tokenizer, weights=False)
    return resolve_model_path(cfg, weights=False)


def load_tokenizer(cfg: ModelConfig):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path(cfg), trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
