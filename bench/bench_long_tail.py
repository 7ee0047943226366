"""Partial rollouts against the long tail: the same seed, budget and staleness bound in three modes, one after
another in this process (each with its own embedded Ray cluster, so they meet the same machine).

    python bench/bench_long_tail.py [--steps 6] [--max-new-tokens 1024] [--slice-tokens 64] [--max-staleness 2]
        [--modes sync,async,partial] [--set key=value ...]

The workload: response lengths with a heavy tail that users would recognise. 1 prompt in 20 asks for a long answer
(it ends with "!") and is answered to the token limit (`--max-new-tokens`); the others (ending with ".") are
answered in about 10 tokens (median; 90% under 40). The model is distrl's tiny random Llama with its weights set so
that it follows that request, deterministically and without training (`long_tail_model`): the last prompt token
puts the first response token in one of two sets of tokens, each of which keeps to itself (its embeddings share a
direction, and the LM head is the embedding matrix); the end-of-sequence row of the head points along the short
set's direction only, so the short set ends after a few tokens and the long set never does.

Modes: `sync`; `async` (`loop.max_staleness` k); `partial` (the same k, `loop.partial_rollouts` with
`loop.slice_tokens`). Prints, for steps 2..N (the first warms the engines up): trained tokens per second (response
tokens the learners trained on, over the steps' wall time), the engines' busy fraction (1 - `idle/rollout`: the share
of time an engine held work), the reward curve, and the partial figures; the last line is
`long tail: partial/async R1x, async/sync R2x`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

from distrl import config
from distrl.driver import train
from distrl.workers.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP = 8, 4
SAMPLES_PER_STEP = PROMPTS * GROUP


def long_tail_model(out: Path, context: int) -> Path:
    """The tiny Llama made to answer a prompt ending in "!" at full length and one ending in "." briefly (see the
    module docstring); its context is `context` tokens (RoPE has no learned positions to outgrow)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(out)
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab, hidden, eos = model.config.vocab_size, model.config.hidden_size, tokenizer.eos_token_id
    (bang,) = tokenizer("!", add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(0)
    order = [i for i in torch.randperm(vocab, generator=g).tolist() if i not in (eos, bang)]
    long, short = [*order[: len(order) // 20], bang], order[len(order) // 20 :]
    emb = torch.randn(vocab, hidden, generator=g)
    emb = emb / emb.norm(dim=1, keepdim=True)
    u = torch.randn(hidden, generator=g)
    u = u / u.norm()  # the short set's direction, which the end-of-sequence row reads
    w = torch.randn(hidden, generator=g)
    w = w - (w @ u) * u
    w = w / w.norm()  # the long set's, orthogonal to it
    emb[short] += u
    emb[long] += w
    emb = emb / emb.norm(dim=1, keepdim=True)
    head = emb * 3.0  # a token's hidden state is mostly its embedding: its own set's tokens score highest
    head[eos] = u * 3.95  # after a short-set token, P(end) ~ 1/11 a token; after a long-set one, ~0
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb * 8.0)  # the residual stream stays dominated by the token
        model.lm_head.weight.copy_(head)
    model.config.max_position_embeddings = context
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.model_max_length = context
    tokenizer.save_pretrained(path)
    return path


def long_tail_data(out: Path, prompts: int = 400, seed: int = 0) -> Path:
    """The toy task's prompts, 1 in 20 (at random, seeded) asking for a long answer."""
    rows = [json.loads(line) for line in (ROOT / "configs" / "data" / "toy.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    path = out / "long_tail.jsonl"
    with path.open("w") as f:
        for i in range(prompts):
            row = rows[i % len(rows)]
            f.write(json.dumps({"prompt": row["prompt"] + ("!" if rng.random() < 0.05 else "."),
                                "answer": row["answer"]}) + "\n")
    return path


def modes(k: int, slice_tokens: int) -> dict[str, list[str]]:
    return {"sync": ["loop.mode=sync"],
            "async": ["loop.mode=async", f"loop.max_staleness={k}"],
            "partial": ["loop.mode=async", f"loop.max_staleness={k}", "loop.partial_rollouts=true",
                        f"loop.slice_tokens={slice_tokens}"]}


def run(out: Path, name: str, model: Path, data: Path, args: argparse.Namespace, overrides: list[str]) -> list[dict]:
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={model}", f"data.path={data}", "data.chat_template=never", "data.max_prompt_tokens=32",
        f"rollout.sampling.max_new_tokens={args.max_new_tokens}", f"rollout.max_model_len={args.max_new_tokens + 32}",
        f"rollout.prompts_per_step={PROMPTS}", f"rollout.n_samples_per_prompt={GROUP}", "learner.micro_batch_size=8",
        "reference.micro_batch_size=8", f"run.output_dir={out}", f"run.name={name}", f"run.steps={args.steps}",
        "run.progress=false", "run.log_every=1000000", "run.checkpoint_at_end=false", "eval=null",
        *overrides, *args.overrides])
    train(cfg)
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--slice-tokens", type=int, default=64)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--modes", default="sync,async,partial")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp())
    model = long_tail_model(out / "model", args.max_new_tokens + 64)
    data = long_tail_data(out)
    every = modes(args.max_staleness, args.slice_tokens)
    results: dict[str, dict] = {}
    for mode in args.modes.split(","):
        rows = run(out, mode, model, data, args, every[mode])[1:]
        seconds = sum(r["time/step"] for r in rows)
        results[mode] = {
            "tokens_per_s": sum(r["learner/tokens"] for r in rows) / seconds, "step_s": seconds / len(rows),
            "busy": 1 - statistics.fmean(r["idle/rollout"] for r in rows),
            "rewards": [r["reward/mean"] for r in rows],
            "length": statistics.fmean(r["learner/tokens"] for r in rows) / SAMPLES_PER_STEP,
            "carried": statistics.fmean(r.get("partial/carried_tokens", 0.0) for r in rows),
            "spanned": max(r.get("tokens/versions_spanned_max", 1.0) for r in rows),
            "stale": max(r["staleness/max"] for r in rows),
            "dropped": sum(r["samples/dropped_stale"] for r in rows)}
    print(f"\nlong tail: max_new_tokens {args.max_new_tokens}, 1 prompt in 20 long; k {args.max_staleness}, "
          f"slice {args.slice_tokens}; steps 2..{args.steps}")
    print(f"{'mode':<9}{'tokens/s':>10}{'step s':>8}{'busy':>7}{'len':>7}{'carried':>9}{'spans':>7}{'stale':>7}"
          f"{'dropped':>9}  reward per step")
    for mode, r in results.items():
        print(f"{mode:<9}{r['tokens_per_s']:>10.1f}{r['step_s']:>8.1f}{r['busy']:>7.0%}{r['length']:>7.1f}"
              f"{r['carried']:>9.0f}{r['spanned']:>7.0f}{r['stale']:>7.0f}{r['dropped']:>9.0f}  "
              + " ".join(f"{x:.3f}" for x in r["rewards"]))
    tps = {m: r["tokens_per_s"] for m, r in results.items()}
    if {"sync", "async", "partial"} <= tps.keys():
        print(f"long tail: partial/async {tps['partial'] / tps['async']:.2f}x, "
              f"async/sync {tps['async'] / tps['sync']:.2f}x")


if __name__ == "__main__":
    main()
