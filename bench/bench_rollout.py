"""Rollout throughput of one vLLM engine (in-process, no Ray): generated tokens/s for a batch of prompts.

    python bench/bench_rollout.py [--hidden 128 --layers 2] [--prompts 32 --n 8 --max-new-tokens 64]

Prints the model size, the engine dtype, and tokens/s over a few timed rounds after one warm-up round.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from distrl.config import ModelConfig, RolloutConfig, SamplingConfig
from distrl.types.prompt import Prompt
from distrl.workers.rollout.worker import RolloutWorker
from distrl.workers.tiny_model import make_tiny_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model_dir = make_tiny_model(tempfile.mkdtemp() + "/model", hidden_size=args.hidden, num_layers=args.layers)
    cfg = RolloutConfig(n_samples_per_prompt=args.n, dtype=args.dtype,
                        sampling=SamplingConfig(max_new_tokens=args.max_new_tokens))
    worker = RolloutWorker(cfg, ModelConfig(path=str(model_dir)), max_prompt_tokens=64, seed=0)
    prompts = [Prompt(index=i, text="", prompt_ids=[0] + [3 + (i * 7 + j) % 200 for j in range(16)])
               for i in range(args.prompts)]
    worker.generate(prompts, list(range(len(prompts))))  # warm-up
    rates = []
    for _ in range(args.rounds):
        start = time.perf_counter()
        out = worker.generate(prompts, list(range(len(prompts))))
        rates.append(sum(len(r) for r in out.response_ids) / (time.perf_counter() - start))
    print(f"model: hidden {args.hidden}, layers {args.layers}; engine dtype {args.dtype}; "
          f"{args.prompts} prompts x {args.n} samples x <= {args.max_new_tokens} new tokens")
    print(f"rollout tokens/s: mean {statistics.fmean(rates):.0f} (rounds: {', '.join(f'{r:.0f}' for r in rates)})")


if __name__ == "__main__":
    main()
