"""Memory per learner process under `replicate` and `fsdp` (`distrl.workers.training.sharding`) with 1, 2 and 4
learners.

A random ~100M-parameter Llama (hidden 768, 12 layers, MLP 2048, vocab 8192: 97.5M parameters) is written once
as HF safetensors; each configuration then runs in fresh processes (a gloo group on 127.0.0.1, one thread each):
load the model (`from_pretrained` for replicas; meta build + per-rank reads for fsdp), two AdamW steps of
`--micro-batches` micro-batches of one sequence of `--tokens` tokens, gradients summed across learners. Per rank:

  state MB   parameter + gradient + optimizer bytes the rank holds after the step, counted tensor by tensor
             (local shards of DTensors; gradients kept, i.e. measured before zero_grad)
  load MB    high-water mark of resident memory (VmHWM) while loading, minus the resident memory after imports and
             group start (file pages that safetensors maps and reads count as resident too)
  train MB   the same high-water mark over the two steps (reset after loading), minus the same base: state,
             activations, transient all-gathered parameters and unsharded gradients, allocator slack
  s/step     wall time of the second step (the machine is shared: compare within a run)

The table shows the largest rank of each configuration and `state / (replica / M)`, the issue's goal being <= 1.2.
A second table compares FSDP gradient accumulation over the micro-batches: reduce-scatter every micro-batch
(`sync each`) or keep gradients unsharded until the last (`sync last`, `sharding.sync_gradients(model, False)`).

    python bench/bench_learner_memory.py [--learners 1 2 4] [--tokens 32] [--micro-batches 4]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch

SIZE = dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12, vocab_size=8192)


def write_model(directory: Path) -> int:
    """Write the random model to `directory`; returns its parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SIZE, num_key_value_heads=SIZE["num_attention_heads"], max_position_embeddings=1024,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := the current resident size


def _local_bytes(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameter + gradient + optimizer-state bytes held by this rank."""
    total = 0
    for p in model.parameters():
        total += _local_bytes(p) + (_local_bytes(p.grad) if p.grad is not None else 0)
    for state in optimizer.state.values():
        total += sum(_local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def step(model, optimizer, ids: torch.Tensor, micro_batches: int, strategy: str, sync: str) -> None:
    from distrl.workers.training import dist, sharding

    for i in range(micro_batches):
        if strategy == "fsdp" and sync == "last":
            sharding.sync_gradients(model, i == micro_batches - 1)
        logits = model(input_ids=ids[i : i + 1]).logits
        (torch.log_softmax(logits.float(), -1)[..., 0].sum() / (ids.numel() * dist.world_size())).backward()
    if strategy == "replicate":
        dist.all_reduce_grads_(list(model.parameters()))
    sharding.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def worker(rank: int, world: int, port: int, model_dir: Path, strategy: str, sync: str, tokens: int,
           micro_batches: int, out: Path) -> None:
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    from distrl.workers.training import dist, sharding

    dist.init_process_group("127.0.0.1", port, rank, world, "cpu")
    baseline = status_mb("VmRSS")
    reset_peak()
    if strategy == "fsdp":
        model = sharding.load_sharded_causal_lm(model_dir, sharding.learner_mesh("cpu"))
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    load_peak = status_mb("VmHWM") - baseline
    reset_peak()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, SIZE["vocab_size"], (micro_batches, tokens), generator=torch.Generator().manual_seed(rank))
    step(model, optimizer, ids, micro_batches, strategy, sync)
    optimizer.zero_grad(set_to_none=True)
    start = time.perf_counter()
    step(model, optimizer, ids, micro_batches, strategy, sync)
    seconds = time.perf_counter() - start
    result = {"state_mb": state_bytes(model, optimizer) / 2**20, "load_mb": load_peak,
              "train_mb": status_mb("VmHWM") - baseline, "seconds": seconds}
    (out / f"{rank}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def run(model_dir: Path, strategy: str, world: int, sync: str, tokens: int, micro_batches: int) -> dict:
    """The largest rank's figures of one configuration, run in `world` fresh processes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(worker, args=(world, port, model_dir, strategy, sync, tokens, micro_batches, Path(out)),
                 nprocs=world)
        ranks = [json.loads(p.read_text()) for p in Path(out).glob("*.json")]
    return {key: max(r[key] for r in ranks) for key in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        params = write_model(model_dir)
        print(f"model: Llama {SIZE}, {params / 1e6:.1f}M parameters; {args.micro_batches} micro-batches x "
              f"{args.tokens} tokens per learner; one thread per learner; largest rank shown")
        print(f"{'strategy':10} {'M':>2} {'state MB':>9} {'vs replica/M':>12} {'load MB':>8} {'train MB':>8} "
              f"{'s/step':>7}")
        replica = None
        for world in args.learners:
            for strategy in ("replicate", "fsdp"):
                r = run(model_dir, strategy, world, "each", args.tokens, args.micro_batches)
                if strategy == "replicate" and world == 1:
                    replica = r["state_mb"]
                ratio = f"{r['state_mb'] / (replica / world):.3f}" if replica else "-"
                print(f"{strategy:10} {world:>2} {r['state_mb']:>9.0f} {ratio:>12} {r['load_mb']:>8.0f} "
                      f"{r['train_mb']:>8.0f} {r['seconds']:>7.2f}", flush=True)
        world = min(w for w in args.learners if w > 1)
        print(f"\nfsdp gradient accumulation over {args.micro_batches} micro-batches, M={world}, interleaved:")
        print(f"{'sync':10} {'state MB':>9} {'load MB':>8} {'train MB':>8} {'s/step':>7}")
        for sync in ("each", "last", "each", "last"):
            r = run(model_dir, "fsdp", world, sync, args.tokens, args.micro_batches)
            print(f"{sync:10} {r['state_mb']:>9.0f} {r['load_mb']:>8.0f} {r['train_mb']:>8.0f} {r['seconds']:>7.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
