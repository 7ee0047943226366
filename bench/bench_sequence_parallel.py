"""Sequence-parallel learners (`learner.sequence_parallel_size`, `distrl.workers.training.ulysses`): the activation
memory of one learner's micro-batch at a long context, k = 1 against k = 2, and two learners sharing every
micro-batch training as one learner does, step for step.

A random Llama (hidden 256, 4 layers, 8 heads, MLP 688, vocab 2048) is written once as HF safetensors. Each
configuration runs in fresh processes (a gloo group on 127.0.0.1, one thread each):

  memory   one forward and backward pass of the policy loss's log-probs over one packed micro-batch of `--tokens`
           tokens (a 512-token prompt and the rest response, float32), on 1 learner and on 2 learners that share it.
           Per rank: `activation MB`, the bytes the autograd graph keeps for the backward pass at the end of the
           forward (every saved tensor's storage once, the model's parameters left out: what grows with the
           context), and `peak MB`, the process's high-water mark of resident memory over the pass less the
           resident memory before it, after freed memory is given back (`malloc_trim`): activations, transients
           (the backward's, the all-to-all's buffers), the head's chunks, allocator slack.
  training `--steps` updates of a `replicate` learner (lr 1e-3) on a batch of 8 sequences of 96 to 160 tokens
           in 2 mini-batches of 4 (2 optimizer steps an update: the second's ratios differ from 1), then the same on 2
           learners with `sequence_parallel_size: 2`: each step's row (policy loss, gradient
           norm, tokens, KL to the old policy, clipped share), and the largest difference between the two runs' rows.

  loop     with `--loop`: the quickstart (configs/quickstart.yaml, Ray and vLLM's CPU build) for `--loop-steps`
           steps, with 1 learner and with 2 `fsdp` learners sharing every micro-batch, same seed: each figure of
           the two runs' rows (times, rates and idle shares left out) compared step by step.

The last lines read `sequence parallel: activations k=2/k=1 0.NNx (peak 0.NNx), rows equal to 1e-N over S steps`.

    python bench/bench_sequence_parallel.py [--tokens 8192] [--steps 4] [--loop] [--loop-steps 5]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

SIZE = dict(hidden_size=256, num_hidden_layers=4, intermediate_size=688, num_attention_heads=8,
            num_key_value_heads=8, vocab_size=2048)
PROMPT = 512
ROW_KEYS = ("loss/policy", "learner/grad_norm", "learner/tokens", "ppo_kl", "clip_frac")


def write_model(directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from distrl.workers.tiny_model import make_tiny_model

    make_tiny_model(directory)  # its tokenizer; the model is replaced by the larger one below
    config = LlamaConfig(**SIZE, max_position_embeddings=65536, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)


def resident_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def long_batch(tokens: int):
    """One sequence of `tokens` tokens: a `PROMPT`-token prompt, the rest response."""
    from distrl.types.batches import Sequences

    g = torch.Generator().manual_seed(0)
    t = tokens - PROMPT
    ids = torch.randint(3, SIZE["vocab_size"], (1, tokens), generator=g)
    return Sequences(input_ids=ids, attention_mask=torch.ones(1, tokens, dtype=torch.long),
                     response_mask=torch.ones(1, t), rollout_logprobs=torch.zeros(1, t),
                     policy_version=torch.zeros(1, dtype=torch.long),
                     response_versions=torch.zeros(1, t, dtype=torch.long))


def training_batch():
    """8 sequences of 96-160 real tokens (64-token prompts, some left-padded; responses of 32-96), advantages
    from -1 to 1."""
    from distrl.types.batches import Sequences, TrainBatch

    g = torch.Generator().manual_seed(0)
    b, p, t = 8, 64, 96
    ids = torch.randint(3, SIZE["vocab_size"], (b, p + t), generator=g)
    attention = torch.ones(b, p + t, dtype=torch.long)
    attention[::3, :16] = 0
    mask = torch.ones(b, t)
    for row in range(b):
        mask[row, 32 + 8 * row:] = 0
        attention[row, p + 32 + 8 * row:] = 0
    adv = torch.linspace(-1, 1, b)[:, None].expand(b, t).contiguous()
    seqs = Sequences(input_ids=ids, attention_mask=attention, response_mask=mask, rollout_logprobs=torch.zeros(b, t),
                     policy_version=torch.zeros(b, dtype=torch.long),
                     response_versions=torch.zeros(b, t, dtype=torch.long))
    return TrainBatch(seqs, old_logprobs=None, advantages=adv, ref_logprobs=None)


def kept_bytes(model: torch.nn.Module, run) -> tuple[object, float]:
    """`run()`'s result and the bytes of the storages its autograd graph saved for backward (each once, the
    parameters' left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params and t.device.type != "meta":
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(saved.values())


def memory(rank: int, world: int, model_dir: str, tokens: int) -> dict:
    from distrl.config import ModelConfig
    from distrl.workers.training import dist
    from distrl.workers.training.model import load_causal_lm, response_logprobs
    from distrl.workers.training.packing import host_layout

    model = load_causal_lm(ModelConfig(path=model_dir), "float32").train()
    seqs = long_batch(tokens)
    layout = host_layout(seqs)
    split = dist.sequence_split()
    layout = layout.split(split) if split else layout
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory of the load back to the system: the base is what is held
    base = resident_mb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM
    logprobs, saved = kept_bytes(model, lambda: response_logprobs(model, seqs, 1.0, layout=layout)[0])
    assert isinstance(logprobs, torch.Tensor)
    (logprobs * seqs.response_mask).sum().backward()
    return {"activation_mb": saved / 2**20, "peak_mb": resident_mb("VmHWM") - base}


def training(rank: int, world: int, model_dir: str, steps: int) -> dict:
    from distrl.config import LearnerConfig, LossConfig, ModelConfig
    from distrl.merging import values
    from distrl.workers.training.learner import Learner

    cfg = LearnerConfig(lr=1e-3, micro_batch_size=4, sequence_parallel_size=world)
    learner = Learner(ModelConfig(path=model_dir), cfg, LossConfig(), temperature=1.0, norm_len=96,
                      mini_batch_size=4, total_optimizer_steps=2 * steps, seed=0)
    if world > 1:
        learner.connect("127.0.0.1", int(os.environ["BENCH_PORT"]), rank, world)
    data = training_batch()
    rows = []
    for _ in range(steps):
        figs = values(learner.update(replace(data, old_logprobs=learner.logprobs(data.sequences))))
        rows.append({key: figs[key] for key in ROW_KEYS})
    return {"rows": rows}


def worker(rank: int, world: int, port: int, what: str, model_dir: str, arg: int, out: str) -> None:
    torch.set_num_threads(1)
    from distrl.workers.training import dist

    if world > 1 and what == "memory":
        dist.init_process_group("127.0.0.1", port, rank, world, "cpu", sequence_parallel=world)
    os.environ["BENCH_PORT"] = str(port)
    result = memory(rank, world, model_dir, arg) if what == "memory" else training(rank, world, model_dir, arg)
    Path(out, f"{rank}.json").write_text(json.dumps(result))
    dist.leave_process_group()


def run(world: int, what: str, model_dir: str, arg: int) -> list[dict]:
    import torch.multiprocessing as mp

    os.environ["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(worker, args=(world, port, what, model_dir, arg, out), nprocs=world, start_method="spawn")
        return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(world)]


UNTIMED = ("time/", "rollout/tokens_per_s", "sync/bytes_per_s", "idle/", "busy/", "throughput/", "rollout/engine_busy")
"""Row figures that measure time or rates, which differ between any two runs."""


def loop_rows(steps: int, out: Path) -> dict[int, list[dict]]:
    """The rows of two quickstart runs under `out`: 1 learner (k 1), and 2 sharded learners sharing every micro-batch
    (k 2)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    common = ["--set", f"run.steps={steps}", "--set", "eval=null", "--set", f"run.output_dir={out}"]
    more = {1: [], 2: ["--set", "cluster.learner.num_actors=2", "--set", "learner.sequence_parallel_size=2",
                       "--set", "learner.strategy.type=fsdp"]}
    rows = {}
    for k, extra in more.items():
        subprocess.run([sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml", *common,
                        "--set", f"run.name=k{k}", *extra], cwd=root, check=True, stdout=subprocess.DEVNULL)
        rows[k] = [json.loads(line) for line in (out / f"k{k}" / "metrics.jsonl").read_text().splitlines()]
    return rows


def compare_loop(rows: dict[int, list[dict]]) -> None:
    shown = ("reward/mean", "learner/tokens", "learner/grad_norm", "loss/policy")
    print(f"{'step':>4} " + " ".join(f"{key + ' k=' + str(k):>22}" for key in shown for k in (1, 2)))
    worst: dict[str, float] = {}
    for one, two in zip(rows[1], rows[2], strict=True):
        print(f"{one['step']:>4} " + " ".join(f"{row[key]:>22.10g}" for key in shown for row in (one, two)))
        for key, value in one.items():
            if isinstance(value, float | int) and not key.startswith(UNTIMED) and key != "step":
                worst[key] = max(worst.get(key, 0.0), abs(value - two[key]) / max(abs(value), 1e-6))
    largest = sorted(worst.items(), key=lambda kv: -kv[1])[:6]
    print(f"{len(worst)} figures compared over {len(rows[1])} steps; largest relative differences: "
          + ", ".join(f"{key} {d:.1e}" for key, d in largest))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the long micro-batch")
    parser.add_argument("--steps", type=int, default=4, help="updates of the training comparison")
    parser.add_argument("--loop", action="store_true", help="also compare two quickstart runs (Ray, vLLM)")
    parser.add_argument("--loop-steps", type=int, default=5, help="steps of each quickstart run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        write_model(Path(directory))
        print(f"model: Llama {SIZE}, float32; one micro-batch of {args.tokens} tokens ({PROMPT} prompt)")
        print(f"{'k':>3} {'rank':>5} {'activation MB':>14} {'peak MB':>9}")
        memories = {}
        for k in (1, 2):
            ranks = run(k, "memory", directory, args.tokens)
            for r, m in enumerate(ranks):
                print(f"{k:>3} {r:>5} {m['activation_mb']:>14.1f} {m['peak_mb']:>9.1f}")
            memories[k] = {key: max(m[key] for m in ranks) for key in ("activation_mb", "peak_mb")}
        runs = {k: run(k, "training", directory, args.steps) for k in (1, 2)}
    print(f"{'step':>4} " + " ".join(f"{key + ' k=' + str(k):>20}" for key in ROW_KEYS for k in (1, 2)))
    worst = 0.0
    for step, (one, two) in enumerate(zip(runs[1][0]["rows"], runs[2][0]["rows"], strict=True)):
        print(f"{step:>4} " + " ".join(f"{row[key]:>20.8g}" for key in ROW_KEYS for row in (one, two)))
        worst = max(worst, *(abs(one[key] - two[key]) / max(abs(one[key]), 1e-6) for key in ROW_KEYS))
    same_ranks = runs[2][0]["rows"] == runs[2][1]["rows"]
    ratio = memories[2]["activation_mb"] / memories[1]["activation_mb"]
    peak = memories[2]["peak_mb"] / memories[1]["peak_mb"]
    print(f"both k=2 learners report the same rows: {same_ranks}")
    if args.loop:
        with tempfile.TemporaryDirectory() as out:
            compare_loop(loop_rows(args.loop_steps, Path(out)))
    print(f"sequence parallel: activations k=2/k=1 {ratio:.2f}x (peak {peak:.2f}x), rows equal to {worst:.1e} "
          f"(relative) over {args.steps} steps")


if __name__ == "__main__":
    main()
