"""The CPU learner's work per step, by the process's own CPU time: reference + old log-probs + update of the packed
learner (bench_learner_step.py's batch and settings) on one thread, whose CPU time load from other processes on a
shared machine hardly changes (its wall time, printed too, it multiplies). For comparing two versions of distrl on a
busy machine: run it in turn against each (PYTHONPATH picks the distrl it imports), several processes each.

    PYTHONPATH=/path/to/distrl-tree OMP_NUM_THREADS=1 python bench/bench_learner_cpu_time.py \\
        [--hidden 128 --layers 2 --prompt 14 --response 16 --max-tokens 4096 --steps 20]

Prompts are `--prompt // 3` to `--prompt` tokens, responses `--response // 4` to `--response`; 64 rows; the first
step warms up. Prints which distrl it ran, then the medians over the steps of the wall and CPU seconds of a step, of
the update's CPU seconds, and the fastest step's CPU seconds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from bench_learner_step import mixed_batch

import distrl
from distrl.config import LearnerConfig, LossConfig, ModelConfig, ReferenceConfig
from distrl.workers.tiny_model import make_tiny_model
from distrl.workers.training.learner import Learner
from distrl.workers.training.reference import ReferenceWorker


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=14)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = ModelConfig(path=str(make_tiny_model(Path(tempfile.mkdtemp()) / "m", hidden_size=args.hidden,
                                                 num_layers=args.layers)))
    loss = LossConfig.model_validate({"kl": {"coef": 0.001, "estimator": "k3", "target": "loss"},
                                      "correction": {"mode": "tis", "low": 0.0, "high": 2.0}})
    micro = {"micro_batch_size": 32, "max_tokens_per_micro_batch": args.max_tokens}
    learner = Learner(model, LearnerConfig(lr=1e-5, **micro), loss, temperature=1.0, norm_len=args.response,
                      mini_batch_size=64, total_optimizer_steps=args.steps + 2, seed=0)
    reference = ReferenceWorker(ReferenceConfig(**micro), model, temperature=1.0)
    batch = mixed_batch(64, (args.prompt // 3, args.prompt), (args.response // 4, args.response), 512, seed=0)
    wall, cpu, update = [], [], []
    for i in range(args.steps + 1):
        start_wall, start_cpu = time.perf_counter(), time.process_time()
        ref = reference.logprobs(batch.sequences)
        old = learner.logprobs(batch.sequences)
        start_update = time.process_time()
        learner.update(replace(batch, old_logprobs=old, ref_logprobs=ref))
        if i:  # the first step warms up
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.process_time() - start_cpu)
            update.append(time.process_time() - start_update)
    print(f"{distrl.__file__} wall {statistics.median(wall):.4f} cpu {statistics.median(cpu):.4f} update_cpu "
          f"{statistics.median(update):.4f} cpu_min {min(cpu):.4f}")


if __name__ == "__main__":
    main()
