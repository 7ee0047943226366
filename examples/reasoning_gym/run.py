"""A tiny model learns a reasoning-gym task with the task's own scorer: one-digit additions (`basic_arithmetic`,
configs/reasoning-gym.yaml), warm-started on the generator's own answers, then GRPO with `score_answer` as the
reward; held-out accuracy (the same generator, another seed) before and after.

    PYTHONPATH=. python -m examples.reasoning_gym.run [--set key=value ...]

1. rows of the training set (seed 1) and the held-out set (seed 2), from reasoning-gym's generator;
2. a random 2-layer Llama whose tokenizer is trained on the task's text (digits kept one token each);
3. a short supervised warm start on `<answer>{the generator's answer}</answer>`, stopped early on purpose, so that
   the policy is right on some problems and GRPO has something to learn;
4. held-out accuracy (the task's `score_answer`, sampled at T = 1 and greedy), GRPO (`distrl.driver.train`), and
   the held-out accuracy of the trained policy. Everything is written under artifacts/reasoning-gym/.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path
from typing import Any

import torch

from distrl import config
from distrl.standards import reasoning_gym
from distrl.workers.tiny_model import make_tiny_model
from examples.calculator.run import trained_model

CONFIG = Path("configs/reasoning-gym.yaml")
ARTIFACTS = Path("artifacts/reasoning-gym")


def completion(row: dict[str, Any]) -> str:
    return f"<answer>{row['answer']}</answer>"


def build_model(out_dir: Path, rows: list[dict[str, Any]], seed: int) -> Path:
    """A random 2-layer Llama (hidden 128) with a tokenizer trained on the rows' text, digits taken out."""
    corpus = [re.sub(r"\d", "", row["prompt"] + completion(row)) for row in rows]
    return make_tiny_model(out_dir, vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, seed=seed,
                           corpus=corpus)


def encode(tokenizer: Any, row: dict[str, Any]) -> tuple[list[int], list[int]]:
    """(prompt ids as distrl tokenizes a plain prompt: BOS, then the text; the answer's ids and EOS)."""
    prompt = tokenizer(row["prompt"], add_special_tokens=True)["input_ids"]
    return prompt, [*tokenizer.encode(completion(row), add_special_tokens=False), tokenizer.eos_token_id]


def warm_start(model_dir: Path, rows: list[dict[str, Any]], steps: int, seed: int, batch_size: int = 32) -> list[float]:
    """Supervised steps on the generator's answers (loss on the answer only); the model is saved in place."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    rng, losses = random.Random(seed), []
    for _ in range(steps):
        pairs = [encode(tokenizer, rng.choice(rows)) for _ in range(batch_size)]
        width = max(len(p) + len(c) for p, c in pairs)
        pad = tokenizer.pad_token_id
        ids = torch.tensor([p + c + [pad] * (width - len(p) - len(c)) for p, c in pairs])
        labels = torch.tensor([[-100] * len(p) + c + [-100] * (width - len(p) - len(c)) for p, c in pairs])
        loss = model(input_ids=ids, attention_mask=(ids != pad).long(), labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(model_dir)
    return losses


def accuracy(model_dir: Path, rows: list[dict[str, Any]], temperature: float, max_new_tokens: int, seed: int = 0,
             batch_size: int = 100) -> float:
    """Mean of the task's own score over `rows`, one answer each, sampled at `temperature` (0: greedy) by HF
    `generate` (left-padded batches)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    sampling = (dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0
                else dict(do_sample=False))
    total = 0.0
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        prompts = [encode(tokenizer, row)[0] for row in batch]
        width = max(map(len, prompts))
        pad = tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=(ids != pad).long(), max_new_tokens=max_new_tokens,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=pad, **sampling)
        for row, tokens in zip(batch, out[:, width:].tolist(), strict=True):
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            total += reasoning_gym.score(row["prompt"], text, row)["reward"]
    return total / len(rows)


def evaluate(model_dir: Path, rows: list[dict[str, Any]], max_new_tokens: int) -> dict[str, float]:
    return {"sampled": accuracy(model_dir, rows, 1.0, max_new_tokens),
            "greedy": accuracy(model_dir, rows, 0.0, max_new_tokens)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--warm-start-steps", type=int, default=150)
    parser.add_argument("--n-eval", type=int, default=300)
    args = parser.parse_args(argv)
    cfg = config.load(CONFIG, args.overrides)
    began = time.perf_counter()
    train_rows = reasoning_gym.rows(**cfg.data.kwargs)
    held_out = reasoning_gym.rows(**{**cfg.data.kwargs, "size": args.n_eval, "seed": cfg.data.kwargs["seed"] + 1})
    warm = Path(cfg.model.path)
    t = time.perf_counter()
    build_model(warm, train_rows, cfg.run.seed)
    losses = warm_start(warm, train_rows, args.warm_start_steps, cfg.run.seed)
    warm_s = time.perf_counter() - t
    tokens = cfg.rollout.sampling.max_new_tokens
    before = evaluate(warm, held_out, tokens)
    print(f"warm start: {args.warm_start_steps} steps in {warm_s:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    print(f"held-out accuracy before GRPO: sampled {before['sampled']:.3f}, greedy {before['greedy']:.3f}")

    from distrl.driver import train

    t = time.perf_counter()
    history = train(cfg)
    grpo_s = time.perf_counter() - t
    after = evaluate(trained_model(Path(cfg.run.output_dir) / cfg.run.name, warm), held_out, tokens)
    print("step  reward")
    for step, h in enumerate(history, start=1):
        print(f"{step:4d}  {h['reward/mean']:6.3f}")
    print(f"held-out accuracy (n = {len(held_out)}, seed {cfg.data.kwargs['seed'] + 1}): sampled "
          f"{before['sampled']:.3f} -> {after['sampled']:.3f}, greedy {before['greedy']:.3f} -> {after['greedy']:.3f}")
    total_s = time.perf_counter() - began
    print(f"wall time: warm start {warm_s:.0f} s, GRPO {grpo_s:.0f} s ({len(history)} steps), total {total_s:.0f} s")
    summary = {"warm_start_s": warm_s, "grpo_s": grpo_s, "total_s": total_s, "before": before, "after": after,
               "reward": [h["reward/mean"] for h in history], "warm_start_loss": [losses[0], losses[-1]]}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
