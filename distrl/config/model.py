"""`model` and `data`: the policy model to train and serve, and the prompts it is trained on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from distrl.config.base import Section


class ModelConfig(Section):
    path: str = Field(min_length=1)
    """Local directory or hub name of the policy model (HF format). The learner trains it, vLLM serves it."""
    tokenizer: str | None = None
    """Tokenizer location; null means the model path."""
    trust_remote_code: bool = False
    """Passed to transformers and vLLM when loading the model and tokenizer."""
    create_tiny_if_missing: bool = False
    """Build distrl's tiny random test model at `path` when nothing is there (seeded, so every node that needs it
    builds identical weights). For the quickstart and tests, where no hub is reachable; never set it for real runs."""


class DataConfig(Section):
    path: str = Field(min_length=1)
    """Prompt file: `.jsonl`, `.parquet`, or a `datasets` directory saved with `save_to_disk`."""
    prompt_key: str = "prompt"
    """Field holding the prompt: a string, or a list of chat messages `{role, content}`."""
    answer_key: str | None = "answer"
    """Field holding the reference answer handed to the reward function; null when the task has none."""
    chat_template: Literal["auto", "always", "never"] = "auto"
    """`auto`: chat messages are rendered with the tokenizer's template, plain strings are used as they are;
    `always`: plain strings are wrapped as one user message and rendered; `never`: messages are an error."""
    max_prompt_tokens: int = Field(default=256, gt=0)
    """Prompts longer than this (in tokens) are dropped at load time and counted."""
    shuffle: bool = True
    """Shuffle the prompt order each epoch, deterministically from `run.seed` and the epoch number."""
