"""Peak memory and time of chunked `token_logprobs` (forward + backward) vs the naive `log_softmax(...).gather`.

Each variant runs in a fresh subprocess, so one variant's allocator state cannot hide another's peak:
  CUDA: torch.cuda.max_memory_allocated() above what was allocated before the step
  CPU:  the kernel's high-water mark of resident memory (VmHWM, reset through /proc/self/clear_refs once the inputs
        exist and a small warm-up ran) minus the resident memory at that moment (VmRSS): what forward + backward
        added, including the [N, V] gradient of the logits, which both variants must produce.
Time is the median of `--repeats` forward + backward passes after the measured one.

    python bench/bench_token_logprobs.py [--rows 4096] [--vocab 32768] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

from distrl.algo import token_logprobs

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def naive(logits: torch.Tensor, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """The textbook version: a full [N, V] float32 log-softmax, saved for backward."""
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def chunked(logits: torch.Tensor, ids: torch.Tensor, temperature: float, chunk_size: int) -> torch.Tensor:
    return token_logprobs(logits, ids, temperature=temperature, chunk_size=chunk_size)


def _status_mb(field: str) -> float:
    """A memory line of /proc/self/status (Linux), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak_rss() -> None:
    """Set the high-water mark to the current RSS ("5" resets VmHWM, proc(5)), so setup peaks do not count."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(args: argparse.Namespace) -> dict:
    """One variant, in this process: returns peak extra MB and median seconds."""
    device = torch.device(args.device)
    fn = naive if args.variant == "naive" else lambda z, i, t: chunked(z, i, t, args.chunk_size)
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(args.rows, args.vocab, generator=g) * 2).to(device, DTYPES[args.dtype]).requires_grad_()
    ids = torch.randint(0, args.vocab, (args.rows,), generator=g).to(device)
    weights = torch.randn(args.rows, generator=g).to(device)

    def step() -> None:
        logits.grad = None
        (fn(logits, ids, args.temperature) * weights).sum().backward()

    small = logits.detach()[:8].clone().requires_grad_()  # warm-up: load kernels, allocator and thread pools
    (fn(small, ids[:8], args.temperature) * weights[:8]).sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
    else:
        _reset_peak_rss()
        before = _status_mb("VmRSS")
        step()
        peak_mb = _status_mb("VmHWM") - before
    times = []
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return {"peak_mb": peak_mb, "seconds": statistics.median(times)}


def run_variant(args: argparse.Namespace, variant: str, dtype: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--dtype", dtype, "--device", args.device,
           "--rows", str(args.rows), "--vocab", str(args.vocab), "--temperature", str(args.temperature),
           "--chunk-size", str(args.chunk_size), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4096, help="B x T positions")
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--chunk-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    parser.add_argument("--dtype", choices=list(DTYPES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    logits_mb = args.rows * args.vocab * 4 / 2**20
    print(f"token_logprobs forward+backward: N={args.rows} rows, V={args.vocab}, temperature={args.temperature}, "
          f"chunk_size={args.chunk_size}, device={args.device} ({torch.get_num_threads()} threads); "
          f"one [N, V] float32 tensor = {logits_mb:.0f} MB")
    print(f"{'dtype':<10}{'variant':<10}{'peak MB':>10}{'seconds':>10}")
    for dtype in args.dtypes:
        res = {v: run_variant(args, v, dtype) for v in ("naive", "chunked")}
        for variant, r in res.items():
            print(f"{dtype:<10}{variant:<10}{r['peak_mb']:>10.0f}{r['seconds']:>10.3f}")
        print(f"{dtype:<10}{'ratio':<10}{res['naive']['peak_mb'] / max(res['chunked']['peak_mb'], 1e-9):>9.2f}x"
              f"{res['naive']['seconds'] / res['chunked']['seconds']:>9.2f}x   (naive / chunked)")


if __name__ == "__main__":
    main()
