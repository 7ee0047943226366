"""Fixtures of the prompt-data tests: an offline Hugging Face cache of each test's own, and the tiny tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def hf_home(tmp_path, monkeypatch) -> Path:
    """A Hugging Face cache of the test's own, offline: `datasets`' Arrow tables land there, not in HOME."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_DATASETS_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
