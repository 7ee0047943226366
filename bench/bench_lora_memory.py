"""A learner's memory with LoRA (`learner.lora`) against full fine-tuning, on the same model and batch.

A random ~100M-parameter Llama (hidden 768, 12 layers, MLP 2048, vocab 8192: 97.5M parameters, as in
bench_learner_memory.py) is written once as HF safetensors. Each configuration then runs in a fresh process: a
`distrl.workers.training.learner.Learner` (local, no Ray, one thread) is built from it and takes two PPO updates of one
optimizer step on `--rows` sequences of `--tokens` tokens. Per configuration:

  trainable M   parameters that train (all of them, or the adapters)
  params MB     bytes of every parameter the learner holds (base + adapters)
  grads MB      bytes of the gradients present at the optimizer step (read inside `optimizer.step`)
  optim MB      bytes of AdamW's state after the steps (two moments per trained parameter, and step counts)
  base MB       resident memory (VmRSS) after imports, before the learner exists
  built MB      resident memory once the learner is built, minus base
  train MB      high-water mark of resident memory (VmHWM, reset once the learner is built) over the two updates,
                minus base: what the learner needed at most (state, activations, allocator slack)
  s/update      wall time of the second update (the machine is shared: compare within a run)

    python bench/bench_lora_memory.py [--rows 8] [--tokens 128] [--ranks 8 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# The model and the /proc readings of bench_learner_memory.py (beside this script), so the two tables compare.
from bench_learner_memory import SIZE, reset_peak, status_mb, write_model


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def one(model_dir: str, rank: int, dtype: str, rows: int, tokens: int) -> dict:
    """Run one configuration in this process (rank 0: full fine-tuning); returns its figures."""
    from distrl.config import LearnerConfig, LossConfig, ModelConfig
    from distrl.types.batches import Sequences, TrainBatch
    from distrl.workers.training.learner import Learner

    torch.set_num_threads(1)
    base = status_mb("VmRSS")
    lora = None if rank == 0 else {"rank": rank, "alpha": 2 * rank}
    cfg = LearnerConfig(lr=1e-4, micro_batch_size=rows, dtype=dtype, lora=lora)
    learner = Learner(ModelConfig(path=model_dir), cfg, LossConfig(), temperature=1.0, norm_len=tokens,
                      mini_batch_size=rows, total_optimizer_steps=10, seed=0)
    built = status_mb("VmRSS") - base
    reset_peak()
    grads: list[int] = []
    step = learner.trainer.optimizer.step

    def measured_step(*args, **kwargs):
        grads.append(_bytes(p.grad for p in learner.trainer.params if p.grad is not None))
        return step(*args, **kwargs)

    learner.trainer.optimizer.step = measured_step  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(0)
    prompt = 8
    ids = torch.randint(0, SIZE["vocab_size"], (rows, prompt + tokens), generator=g)
    seqs = Sequences(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(rows, tokens),
                     rollout_logprobs=torch.zeros(rows, tokens), policy_version=torch.zeros(rows, dtype=torch.long),
                     response_versions=torch.zeros(rows, tokens, dtype=torch.long))
    advantages = torch.linspace(-1, 1, rows)[:, None].expand(rows, tokens).contiguous()
    seconds = 0.0
    for _ in range(2):
        began = time.perf_counter()
        old = learner.logprobs(seqs)
        learner.update(TrainBatch(seqs, old_logprobs=old, advantages=advantages, ref_logprobs=None))
        seconds = time.perf_counter() - began
    params = list(learner.model.parameters())
    optim = [t for state in learner.trainer.optimizer.state.values() for t in state.values()
             if isinstance(t, torch.Tensor)]
    return {"config": "full" if rank == 0 else f"lora r={rank}", "dtype": dtype,
            "trainable M": sum(p.numel() for p in learner.trainer.params) / 1e6,
            "params MB": _bytes(params) / 2**20, "grads MB": max(grads) / 2**20, "optim MB": _bytes(optim) / 2**20,
            "base MB": base, "built MB": built, "train MB": status_mb("VmHWM") - base, "s/update": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "RANK", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.one[2], args.rows, args.tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        count = write_model(Path(tmp))
        print(f"model: random Llama {SIZE}, {count / 1e6:.1f}M parameters; batch {args.rows} x {args.tokens} tokens; "
              f"torch {torch.__version__}, 1 thread")
        runs = [(0, "float32"), *((r, "float32") for r in args.ranks), (args.ranks[0], "bfloat16")]
        results = []
        for rank, dtype in runs:
            out = subprocess.run([sys.executable, __file__, "--one", tmp, str(rank), dtype, "--rows", str(args.rows),
                                  "--tokens", str(args.tokens)], capture_output=True, text=True, check=True)
            results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    keys = list(results[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in results:
        print("| " + " | ".join(f"{v:.3f}" if k == "trainable M" else f"{v:.2f}" if k == "s/update" else
                                f"{v:.0f}" if isinstance(v, float) else str(v) for k, v in r.items()) + " |")


if __name__ == "__main__":
    main()
