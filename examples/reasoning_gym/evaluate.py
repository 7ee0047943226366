"""Held-out accuracy of a model on reasoning-gym rows, one answer per question sampled by HF `generate` (left-padded
batches) at the training temperature or greedily, scored by the task's own scorer (`distrl.standards.
reasoning_gym:score`, as the training reward).

Two figures, because the scorer gives partial credit (an answer that holds the right one and more earns its length
over the answer's): `score`, the scorer's mean, and `exact`, the share of answers it gives full credit (what
distrl's held-out sets report as pass@1, with `eval.pass_threshold` 1).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distrl.standards import reasoning_gym
from examples.reasoning_gym.warm_start import encode


@dataclass(frozen=True)
class Accuracy:
    exact: float
    score: float
    n: int


def accuracy(model_dir: Path, rows: list[dict[str, Any]], temperature: float, max_new_tokens: int, seed: int = 0,
             batch_size: int = 100) -> Accuracy:
    """One answer per row, sampled at `temperature` (0: greedy), scored by the task's scorer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))
    exact, score, pad = 0, 0.0, tokenizer.pad_token_id
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        prompts = [encode(tokenizer, row["prompt"], "")[0] for row in batch]
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, **sampling)
        for row, tokens in zip(batch, out[:, width:].tolist(), strict=True):
            reward = reasoning_gym.score(row["prompt"], tokenizer.decode(tokens, skip_special_tokens=True),
                                         row)["reward"]
            exact += reward >= 1.0
            score += reward
    torch.random.set_rng_state(generator_state)
    return Accuracy(exact=exact / len(rows), score=score / len(rows), n=len(rows))


def evaluate(model_dir: Path, rows: list[dict[str, Any]], max_new_tokens: int,
             temperature: float = 1.0) -> dict[str, Accuracy]:
    """{"sampled": at `temperature`, "greedy": greedy} accuracies of `model_dir` on `rows`."""
    return {"sampled": accuracy(model_dir, rows, temperature, max_new_tokens),
            "greedy": accuracy(model_dir, rows, 0.0, max_new_tokens)}
