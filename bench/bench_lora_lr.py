"""LoRA's learning rate on a model that learns: the calculator example's warm-started tiny Llama (it calls the
tool on about 40% of problems and is right on about 20%, sampled), trained with GRPO by LoRA adapters at several
learning rates, and by full fine-tuning at the example's own rate, in one run.

    PYTHONPATH=. .venv/bin/python bench/bench_lora_lr.py [--steps 60] [--lrs 1e-2,5e-3,2e-3,1e-3] [--rank 8]
        [--full-lr 5e-4] [--warm-start-steps 800]

Each run starts from the same warm-started model and seed (`configs/agent-calculator.yaml`, 8 prompts x 8
samples a step, LoRA on every projection with alpha = 2 x rank). Reported per run: the training reward (64
episodes a step) over the first and the last 10 steps, the lowest and highest 5-step mean, the tool calls per
episode at the end, and the step at which `run.reward_collapse` (its defaults) warned, if it did.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.calculator.problems import make_splits, write_jsonl  # noqa: E402
from examples.calculator.warm_start import build_model, warm_start  # noqa: E402


def smoothed(values: list[float], window: int = 5) -> list[float]:
    return [statistics.fmean(values[i - window:i]) for i in range(window, len(values) + 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--lrs", default="1e-2,5e-3,2e-3,1e-3", help="LoRA learning rates, comma-separated")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--full-lr", type=float, default=5e-4, help="full fine-tuning's rate (0: no such run)")
    parser.add_argument("--warm-start-steps", type=int, default=800)
    args = parser.parse_args()

    from distrl import config
    from distrl.driver import train

    out = Path(tempfile.mkdtemp(prefix="bench-lora-lr-"))
    train_rows, _ = make_splits(2000, 0, seed=0)
    write_jsonl(train_rows, out / "train.jsonl")
    t = time.perf_counter()
    losses = warm_start(build_model(out / "base", train_rows[:100], seed=0), out / "warm", train_rows,
                      steps=args.warm_start_steps, tool_frac=0.5, seed=0)
    print(f"warm start: {args.warm_start_steps} steps in {time.perf_counter() - t:.0f} s, loss {losses[0]:.2f} -> "
          f"{losses[-1]:.2f}", flush=True)

    runs = {f"LoRA r{args.rank} lr {lr}": [f"learner.lr={lr}", f"learner.lora={{rank: {args.rank}, "
                                               f"alpha: {2 * args.rank}}}"]
            for lr in args.lrs.split(",")}
    if args.full_lr:
        runs[f"full lr {args.full_lr:g}"] = [f"learner.lr={args.full_lr}"]
    results = {}
    for name, overrides in runs.items():
        cfg = config.load(ROOT / "configs" / "agent-calculator.yaml", [
            f"model.path={out / 'warm'}", f"data.path={out / 'train.jsonl'}", f"run.output_dir={out}",
            f"run.name=run-{len(results)}", f"run.steps={args.steps}", "run.progress=false",
            "run.log_every=1000000", "run.checkpoint_at_end=false", *overrides])
        t = time.perf_counter()
        rows = train(cfg)
        episodes = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
        rewards = [r["reward/mean"] for r in rows]
        curve = smoothed(rewards)
        warned = next((r["step"] for r in rows if r.get("health/reward_collapsed")), None)
        results[name] = (statistics.fmean(rewards[:10]), statistics.fmean(rewards[-10:]), min(curve), max(curve),
                         statistics.fmean(r["agent/tool_calls"] / episodes for r in rows[-10:]), warned)
        print(f"{name}: {time.perf_counter() - t:.0f} s; reward per step: "
              + " ".join(f"{r:.2f}" for r in rewards), flush=True)

    print(f"\n{'run':<24} {'reward 1-10':>11} {'last 10':>8} {'min 5-step':>10} {'max 5-step':>10} "
          f"{'calls/ep':>8}  collapse warned")
    for name, (first, last, low, high, calls, warned) in results.items():
        print(f"{name:<24} {first:11.3f} {last:8.3f} {low:10.3f} {high:10.3f} {calls:8.2f}  "
              f"{'step ' + str(warned) if warned else 'no'}")


if __name__ == "__main__":
    main()
