"""Repositories written into a Hugging Face hub cache as `hf download` leaves them, for tests that resolve hub names
with the offline switches on (no test can reach the hub): `<cache>/{models,datasets}--ORG--NAME/` holding
`blobs/<sha256>` (the files' contents), `snapshots/<commit>/<path>` (links to those blobs) and `refs/main` (the
commit), which is what huggingface_hub's `snapshot_download` reads offline."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def cache_repo(cache: Path, repo_type: str, name: str, files: dict[str, bytes]) -> Path:
    """Write `files` (path in the repository -> content) as the `main` revision of hub repository `name` of
    `repo_type` ("model" or "dataset") into the hub cache `cache`; returns the snapshot directory."""
    repo = cache / f"{repo_type}s--{name.replace('/', '--')}"
    commit = hashlib.sha1(name.encode()).hexdigest()  # any 40-hex id: refs/main names it
    snapshot = repo / "snapshots" / commit
    for path, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def parquet_bytes(columns: dict[str, list]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue().to_pybytes()


def cache_gsm8k_like(cache: Path, name: str = "openai/gsm8k", train: int = 8) -> Path:
    """A data set laid out as the hub's `openai/gsm8k`: configurations `main` and `socratic` (declared in the card's
    `configs:`), each with a train and a test split of `question` / `answer` parquet files."""
    card = ("---\nconfigs:\n"
            + "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/train-*\n"
                      f"  - split: test\n    path: {c}/test-*\n" for c in ("main", "socratic"))
            + "---\n# a GSM8K-shaped test set\n")
    files = {"README.md": card.encode()}
    for config in ("main", "socratic"):
        for split, n in (("train", train), ("test", 2)):
            rows = [(a, a + 1) for a in range(n)]
            files[f"{config}/{split}-00000-of-00001.parquet"] = parquet_bytes({
                "question": [f"Count on: {a} {b}" for a, b in rows],
                "answer": [f"{a} then {b}, so the next is {b + 1}.\n#### {b + 1}" for a, b in rows]})
    return cache_repo(cache, "dataset", name, files)


def cache_model(cache: Path, name: str, model_dir: Path) -> Path:
    """The model in `model_dir` (a saved HF model and tokenizer) as hub repository `name` in `cache`."""
    return cache_repo(cache, "model", name, {p.relative_to(model_dir).as_posix(): p.read_bytes()
                                             for p in sorted(model_dir.rglob("*")) if p.is_file()})


def gsm8k_reward(prompt: str, completion: str, sample: dict) -> float:
    """1 when the completion holds the final number of a GSM8K-style answer (`... #### N`). Raises unless the
    reward received the row's columns, so that a run proves what its reward was handed."""
    if set(sample) != {"question", "answer"} or not sample["answer"].rsplit("####", 1)[-1].strip().isdigit():
        raise ValueError(f"the reward received {sample}, not a GSM8K row")
    return float(sample["answer"].rsplit("####", 1)[-1].strip() in completion)
