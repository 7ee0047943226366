"""Partial rollouts against the long tail: the same seeds, budget and staleness bound in three modes, one run after
another in this process (each with its own embedded Ray cluster, so they meet the same machine).

    python bench/bench_long_tail.py [--steps 6] [--seeds 0] [--max-new-tokens 1024] [--slice-tokens 64]
        [--max-staleness 2] [--modes sync,async,partial] [--set key=value ...]

The workload: prompts that ask for an answer of a stated length in words, with a heavy tail that users would
recognise. 1 prompt in 20 (it ends with "!") asks for `--max-new-tokens` words and is answered to the token limit;
the others (ending with ".") ask for 4 words and are answered in about 10 (median; 90% under 35, about 1 in 60 past
64). The reward (`bench/stated_length.py`) is how close the answer's length is to the asked one: min(n, L) / max(n,
L) for n words asked L. The model is distrl's tiny random Llama with its weights set so that it follows that
request without training (`long_tail_model`), warm-started in that sense: the last prompt token puts the first
response token in one of two sets of whole-word tokens (so that an answer's words are its tokens), each of which
keeps to itself (its embeddings share a direction; the LM head reads that direction); the end-of-sequence row of
the head points along the short set's direction only, so a short answer ends with a chance of about 1 in 11 a
token and a long one never does. What is learned is to end the short answers sooner (a long group's samples all
score 1: no advantage, nothing learned from them, and the tail stays).

Modes: `sync`; `async` (`loop.max_staleness` k); `partial` (the same k, `loop.partial_rollouts` with
`loop.slice_tokens`). Prints, per mode and seed over steps 2..N (the first warms the engines up): trained tokens per
second (response tokens the learners trained on, over the steps' wall time), the engines' busy fraction (1 -
`idle/rollout`: the share of time an engine held work) and the partial figures; then the reward curves (the mean
reward of steps 1..N in windows) of every run, each mode's mean over seeds and spread (max - min over seeds), and
whether partial's mean curve is within async's spread. Tokens per second of a mode are summed over its seeds. The
last line is `long tail: partial/async R1x, async/sync R2x`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

from distrl import config
from distrl.driver import train
from distrl.workers.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP = 8, 4
SAMPLES_PER_STEP = PROMPTS * GROUP
SHORT_WORDS = 4
"""The length a short prompt asks for; the model answers in about 10 words before it learns."""
EOS_SCALE, SPREAD = 3.1, 0.3
"""The end-of-sequence row's length along the short direction (P(end) about 1 in 11 a token: measured, HF sampling
at T = 1) and the length of each embedding's own random part beside its set's direction."""
WINDOW = 5


def long_tail_model(out: Path, context: int) -> Path:
    """The tiny Llama made to answer a prompt ending in "!" at full length and one ending in "." briefly, in whole-word
    tokens only (see the module docstring); its context is `context` tokens (RoPE has no learned positions to
    outgrow)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_model(out)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    vocab, hidden, eos = model.config.vocab_size, model.config.hidden_size, tokenizer.eos_token_id
    (bang,) = tokenizer("!", add_special_tokens=False)["input_ids"]
    g = torch.Generator().manual_seed(0)
    order = [i for i in torch.randperm(vocab, generator=g).tolist() if i not in (eos, bang)]
    long, short = [*order[: len(order) // 20], bang], order[len(order) // 20 :]
    pieces = tokenizer.convert_ids_to_tokens(list(range(vocab)))
    words = [i for i in order if pieces[i].startswith("\u0120") and len(pieces[i]) > 1]  # a space, then a word
    emb = torch.randn(vocab, hidden, generator=g)
    emb = emb / emb.norm(dim=1, keepdim=True) * SPREAD
    u = torch.randn(hidden, generator=g)
    u = u / u.norm()  # the short set's direction, which the end-of-sequence row reads
    w = torch.randn(hidden, generator=g)
    w = w - (w @ u) * u
    w = w / w.norm()  # the long set's, orthogonal to it
    emb[short] += u
    emb[long] += w
    emb = emb / emb.norm(dim=1, keepdim=True)
    # A token's hidden state is mostly its embedding, so its own set's words score highest; a token that is not a
    # word is never answered. With SPREAD small every short token's state is alike, and so is P(end) after it.
    head = -3.0 * (u + w).expand(vocab, hidden).clone()
    head[words] = emb[words] * 3.0
    head[eos] = u * EOS_SCALE
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb * 8.0)  # the residual stream stays dominated by the token
        model.lm_head.weight.copy_(head)
    model.config.max_position_embeddings = context
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.model_max_length = context
    tokenizer.save_pretrained(path)
    return path


def long_tail_data(out: Path, long_words: int, prompts: int = 400, seed: int = 0) -> Path:
    """The toy task's prompts, each asking for an answer of a stated length: 1 in 20 (at random, seeded)
    `long_words` words (ending "!"), the others `SHORT_WORDS` (ending ".")."""
    rows = [json.loads(line) for line in (ROOT / "configs" / "data" / "toy.jsonl").read_text().splitlines()]
    rng = random.Random(seed)
    path = out / "long_tail.jsonl"
    with path.open("w") as f:
        for i in range(prompts):
            words, end = (long_words, "!") if rng.random() < 0.05 else (SHORT_WORDS, ".")
            f.write(json.dumps({"prompt": f"{rows[i % len(rows)]['prompt']}. Answer in {words} words{end}",
                                "words": words}) + "\n")
    return path


def modes(k: int, slice_tokens: int) -> dict[str, list[str]]:
    return {"sync": ["loop.mode=sync"],
            "async": ["loop.mode=async", f"loop.max_staleness={k}"],
            "partial": ["loop.mode=async", f"loop.max_staleness={k}", "loop.partial_rollouts=true",
                        f"loop.slice_tokens={slice_tokens}"]}


def run(out: Path, name: str, model: Path, data: Path, seed: int, args: argparse.Namespace,
        overrides: list[str]) -> list[dict]:
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={model}", f"data.path={data}", "data.chat_template=never", "data.max_prompt_tokens=32",
        "reward.function=stated_length:stated_length", f"rollout.sampling.max_new_tokens={args.max_new_tokens}",
        f"rollout.max_model_len={args.max_new_tokens + 32}", f"rollout.prompts_per_step={PROMPTS}",
        f"rollout.n_samples_per_prompt={GROUP}", "learner.micro_batch_size=8", "reference.micro_batch_size=8",
        f"run.output_dir={out}", f"run.name={name}", f"run.steps={args.steps}", f"run.seed={seed}",
        "run.progress=false", "run.log_every=1000000", "run.checkpoint_at_end=false", "eval=null",
        *overrides, *args.overrides])
    train(cfg)
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def windows(rewards: list[float]) -> list[float]:
    return [statistics.fmean(rewards[i:i + WINDOW]) for i in range(0, len(rewards), WINDOW)]


def report_rewards(curves: dict[str, dict[int, list[float]]], steps: int) -> None:
    """Every run's reward in windows of `WINDOW` steps, each mode's mean over seeds and spread, and whether partial's
    mean lies within async's spread (the range of async's seeds) window by window."""
    heads = [f"{i + 1}-{min(i + WINDOW, steps)}" for i in range(0, steps, WINDOW)]
    print(f"\nreward, mean per {WINDOW} steps")
    print(f"{'run':<18}" + "".join(f"{h:>8}" for h in heads) + f"{'all':>8}")
    spans: dict[str, tuple[list[float], list[float]]] = {}
    for mode, seeds in curves.items():
        per_seed = {seed: windows(rewards) for seed, rewards in seeds.items()}
        for seed, w in per_seed.items():
            print(f"{f'{mode}-seed{seed}':<18}" + "".join(f"{x:>8.3f}" for x in w)
                  + f"{statistics.fmean(seeds[seed]):>8.3f}")
        columns = list(zip(*per_seed.values(), strict=True))
        low, high = [min(c) for c in columns], [max(c) for c in columns]
        spans[mode] = (low, high)
        overall = [statistics.fmean(r) for r in seeds.values()]
        print(f"{f'{mode} mean':<18}" + "".join(f"{statistics.fmean(c):>8.3f}" for c in columns)
              + f"{statistics.fmean(overall):>8.3f}")
        print(f"{f'{mode} spread':<18}" + "".join(f"{h - lo:>8.3f}" for lo, h in zip(low, high, strict=True))
              + f"{max(overall) - min(overall):>8.3f}")
    if {"async", "partial"} <= curves.keys() and len(curves["async"]) > 1:
        low, high = spans["async"]
        mean = [statistics.fmean(c) for c in zip(*(windows(r) for r in curves["partial"].values()), strict=True)]
        inside = [lo <= m <= h for m, lo, h in zip(mean, low, high, strict=True)]
        print(f"partial's mean within async's spread: {sum(inside)} of {len(inside)} windows ("
              + " ".join("yes" if i else "no" for i in inside) + ")")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seeds", default="0", help="run seeds, comma-separated: each mode runs once per seed")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--slice-tokens", type=int, default=64)
    ap.add_argument("--max-staleness", type=int, default=2)
    ap.add_argument("--modes", default="sync,async,partial")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    # The reward tasks (and the driver's preflight) import stated_length from this directory.
    sys.path.insert(0, str(ROOT / "bench"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))
    out = Path(tempfile.mkdtemp())
    model = long_tail_model(out / "model", args.max_new_tokens + 64)
    data = long_tail_data(out, args.max_new_tokens)
    every = modes(args.max_staleness, args.slice_tokens)
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, dict[int, list[dict]]] = {mode: {} for mode in args.modes.split(",")}
    for seed in seeds:
        for mode, by_seed in runs.items():
            by_seed[seed] = run(out, f"{mode}-seed{seed}", model, data, seed, args, every[mode])
    print(f"\nlong tail: max_new_tokens {args.max_new_tokens}, 1 prompt in 20 long; k {args.max_staleness}, "
          f"slice {args.slice_tokens}; seeds {args.seeds}; steps 2..{args.steps}")
    print(f"{'run':<18}{'tokens/s':>10}{'step s':>8}{'busy':>7}{'len':>7}{'carried':>9}{'spans':>7}{'stale':>7}"
          f"{'dropped':>9}{'at limit':>10}")
    tokens, seconds = dict.fromkeys(runs, 0.0), dict.fromkeys(runs, 0.0)
    for mode, by_seed in runs.items():
        for seed, all_rows in by_seed.items():
            rows = all_rows[1:]
            took = sum(r["time/step"] for r in rows)
            trained = sum(r["learner/tokens"] for r in rows)
            tokens[mode] += trained
            seconds[mode] += took
            print(f"{f'{mode}-seed{seed}':<18}{trained / took:>10.1f}{took / len(rows):>8.1f}"
                  f"{1 - statistics.fmean(r['idle/rollout'] for r in rows):>7.0%}"
                  f"{trained / len(rows) / SAMPLES_PER_STEP:>7.1f}"
                  f"{statistics.fmean(r.get('partial/carried_tokens', 0.0) for r in rows):>9.0f}"
                  f"{max(r.get('tokens/versions_spanned_max', 1.0) for r in rows):>7.0f}"
                  f"{max(r['staleness/max'] for r in rows):>7.0f}{sum(r['samples/dropped_stale'] for r in rows):>9.0f}"
                  f"{sum(r['response_length/truncated_frac'] * SAMPLES_PER_STEP for r in rows):>10.0f}")
    report_rewards({mode: {seed: [r["reward/mean"] for r in rows] for seed, rows in by_seed.items()}
                    for mode, by_seed in runs.items()}, args.steps)
    tps = {mode: tokens[mode] / seconds[mode] for mode in runs}
    print("\ntrained tokens/s over all seeds: " + ", ".join(f"{m} {v:.1f}" for m, v in tps.items()))
    if {"sync", "async", "partial"} <= tps.keys():
        print(f"long tail: partial/async {tps['partial'] / tps['async']:.2f}x, "
              f"async/sync {tps['async'] / tps['sync']:.2f}x")


if __name__ == "__main__":
    main()
