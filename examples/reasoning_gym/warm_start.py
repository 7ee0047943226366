"""Warm start: a tiny random Llama, then a short supervised training on the generator's own answers, mixed with
the most natural wrong one (the words in the order given, not reversed), as the calculator example mixes calls
and guesses: the warm-started policy can write both, and GRPO has to find which one the task's scorer rewards.

Every example is a question of its own (the generator makes as many as the steps need): on 2000 questions seen
over and over, a tiny model learns those questions by heart and answers new ones almost never; on new ones each
step it learns to copy words, and answers questions it never saw. The tokenizer is distrl's tiny BPE tokenizer
trained on the first rows' text (digits taken out, so that a number stays one token per digit), with room for
most of the task's words to be one token each. An example is what a rollout holds: the prompt as distrl tokenizes
a plain prompt (BOS, then the question), the completion and the end-of-turn token; only the completion is trained
on.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import torch

from distrl.workers.tiny_model import make_tiny_model


def completion(answer: str) -> str:
    """A completion as the task's scorer reads it: the answer between `<answer>` tags."""
    return f"<answer>{answer}</answer>"


def unreversed(row: dict[str, Any]) -> str:
    """The wrong answer the warm start mixes in: the row's words in the order the question gives them."""
    return ", ".join(row["metadata"]["words"])


def build_model(out_dir: str | Path, rows: list[dict[str, Any]], seed: int = 0, vocab_size: int = 2048) -> Path:
    """A random 2-layer Llama (hidden 128) whose tokenizer is trained on the rows' questions and answers."""
    corpus = [re.sub(r"\d", "", row["prompt"] + completion(row["answer"])) for row in rows]
    return make_tiny_model(out_dir, vocab_size=vocab_size, hidden_size=128, num_layers=2, num_heads=4, seed=seed,
                           corpus=corpus)


def encode(tokenizer: Any, prompt: str, text: str) -> tuple[list[int], list[int]]:
    """(the prompt's ids as distrl tokenizes a plain prompt: BOS, then the text; `text`'s ids and EOS)."""
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return ids, [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def warm_start(model_dir: Path, rows: list[dict[str, Any]], steps: int, seed: int = 0, right_frac: float = 0.5,
               batch_size: int = 32, lr: float = 2e-3) -> list[float]:
    """`steps` supervised steps of `batch_size` rows each, in a shuffled order (each row once while they last),
    each answered with the generator's answer (a share `right_frac`) or the words unreversed; the loss is on the
    completion only. The model is saved in place; returns the losses."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng, losses, pad = random.Random(seed), [], tokenizer.pad_token_id
    order = rng.sample(range(len(rows)), len(rows))
    for step in range(steps):
        pairs = []
        for row in (rows[order[(step * batch_size + k) % len(rows)]] for k in range(batch_size)):
            answer = row["answer"] if rng.random() < right_frac else unreversed(row)
            pairs.append(encode(tokenizer, row["prompt"], completion(answer)))
        width = max(len(p) + len(c) for p, c in pairs)
        ids = torch.tensor([p + c + [pad] * (width - len(p) - len(c)) for p, c in pairs])
        labels = torch.tensor([[-100] * len(p) + c + [-100] * (width - len(p) - len(c)) for p, c in pairs])
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(model_dir)
    return losses
