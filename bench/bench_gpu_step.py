"""distrl's learner step against a hand-written PyTorch step on one CUDA GPU, measured in one run: seconds per
optimizer step and their ratio, tokens/s, MFU, peak memory and host synchronisations per step, and the reference's
forward pass, for randomly initialised Qwen2 models of Qwen2.5's shapes (0.5B, 1.5B, 3B, 7B) and each kernel choice
(`learner.kernels`: plain, liger, compile). Needs torch (CUDA), transformers and pydantic; liger-kernel for the
liger rows (skipped, with the reason, without it). No hub: the models are written locally at random.

    python bench/bench_gpu_step.py [--shapes 0.5B,1.5B,3B] [--seqs 64] [--micro 8] [--prompt 256] [--response 768]
                                   [--kernels plain,liger,compile] [--reference liger] [--budget auto] [--steps 3]
                                   [--checkpointing] [--fsdp] [--offload] [--no-hand]

Each step is one optimizer step on `--seqs` sequences of `--prompt` + `--response` random tokens (one mini-batch,
one PPO epoch), in micro-batches of `--micro` sequences (both steps alike; `--budget auto` adds a distrl row with
`learner.max_tokens_per_micro_batch: auto`). Two steps warm up; the next `--steps` are timed, the device
synchronised around each, and the median is reported.

The hand-written step (`HandWritten`) is what a user writes in an afternoon: the same random model loaded in float32
with sdpa attention, each micro-batch's forward under bfloat16 autocast with logits at every position, log-softmax
and gather at the response positions, the policy-gradient loss -A log p summed over response tokens over the
batch's response tokens, backward, gradient clipping at 1.0, fused AdamW. distrl is `Learner.update` (replicated,
packed rows, the chunked head, weights cast once per forward, on-policy: old log-probs from the update's own
forward). "syncs" is the number of synchronising CUDA calls of one step (`torch.cuda.set_sync_debug_mode`), and
for distrl also its CPU count of host-waiting calls (`distrl.workers.training.host_syncs`).

MFU counts model FLOPs (the recompute of gradient checkpointing excluded), forward plus backward = 3 x forward:
  - 6 * N * tokens, N the parameters of the decoder layers (embedding lookups are not matmuls);
  - 6 * hidden * vocab * K for the LM head, K the positions whose logits are made (distrl makes them only where a
    response token is predicted: K = response tokens; the hand-written step at every position);
  - attention scores and values, causal: 6 * layers * hidden * s^2 per sequence of s tokens (the usual
    12 * layers * hidden * s per token, halved by the causal mask);
against the device's dense bfloat16 peak (`PEAK_BF16_TFLOPS`, looked up from the device name; none for a device
the table lacks, and no MFU then). The reference's forward is timed on the same batch with
`ReferenceWorker.logprobs` (bfloat16 weights, no gradient).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_model import SHAPES, peak_tflops, step_flops, write_model


def make_batch(seqs: int, prompt: int, response: int, vocab: int):
    """`seqs` full-length sequences of random tokens, advantages of both signs, no old log-probs (one optimizer step
    takes its own, detached)."""
    from distrl.types.batches import Sequences, TrainBatch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (seqs, prompt + response), generator=g)
    sequences = Sequences(input_ids=ids, attention_mask=torch.ones_like(ids), response_mask=torch.ones(seqs, response),
                          rollout_logprobs=torch.zeros(seqs, response),
                          policy_version=torch.zeros(seqs, dtype=torch.long),
                          response_versions=torch.zeros(seqs, response, dtype=torch.long))
    advantages = torch.linspace(-1, 1, seqs)[:, None].expand(seqs, response).contiguous()
    return TrainBatch(sequences, old_logprobs=None, advantages=advantages, ref_logprobs=None)


class HandWritten:
    """The plain PyTorch step of the module docstring, on the model in `directory`."""

    def __init__(self, directory: Path, micro: int, prompt: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                          attn_implementation="sdpa").cuda().train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-6, fused=True)
        self.micro, self.prompt = micro, prompt

    def step(self, batch) -> None:
        ids = batch.sequences.input_ids.cuda()
        advantages = batch.advantages.cuda()
        p, tokens = self.prompt, batch.response_mask.sum()
        for i in range(0, ids.shape[0], self.micro):
            rows = ids[i:i + self.micro]
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = self.model(input_ids=rows).logits
            logp = torch.log_softmax(logits[:, p - 1:-1].float(), -1).gather(-1, rows[:, p:, None]).squeeze(-1)
            loss = -(advantages[i:i + self.micro] * logp).sum() / tokens
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timed(step: Callable[[], None], steps: int) -> tuple[float, float, int]:
    """(median seconds of `steps` calls after two warm-up calls, peak GiB, synchronising CUDA calls of one more)."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return statistics.median(times), peak, syncs


@dataclass
class Row:
    """One line of the table."""

    shape: str
    what: str
    seconds: float | None = None
    peak_gib: float | None = None
    syncs: int | None = None
    cpu_syncs: int | None = None
    mfu: float | None = None
    tokens_per_s: float | None = None
    ratio: float | None = None
    note: str = ""

    def line(self) -> str:
        def f(x, fmt):
            return "-" if x is None else format(x, fmt)
        mfu = None if self.mfu is None else 100 * self.mfu
        return (f"| {self.shape} | {self.what} | {f(self.seconds, '.3f')} | {f(self.ratio, '.2f')} | "
                f"{f(self.tokens_per_s, '.0f')} | {f(mfu, '.1f')} | {f(self.peak_gib, '.1f')} | "
                f"{f(self.syncs, 'd')} | {f(self.cpu_syncs, 'd')} | {self.note} |")


HEADER = ("| model | step | s/step | distrl/hand | tokens/s | MFU % | peak GiB | CUDA syncs | CPU-counted syncs "
          "| note |\n|---|---|---|---|---|---|---|---|---|---|")


def liger_problem() -> str | None:
    """Why the liger rows cannot run here, or None."""
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError as e:
        return f"liger-kernel not importable ({e})"
    return None


@dataclass(frozen=True)
class Setup:
    """What every row of one shape shares."""

    shape: str
    directory: str
    seqs: int
    micro: int
    prompt: int
    response: int
    steps: int
    checkpointing: bool = False
    fsdp: bool = False
    offload: bool = False

    @property
    def tokens(self) -> int:
        return self.seqs * (self.prompt + self.response)


def header(seqs: int, prompt: int, response: int) -> str:
    """The run's first lines: the device, torch, the peak the MFU is against, the batch, the table's header."""
    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_step: CUDA is not available")
    name = torch.cuda.get_device_name()
    return (f"bench_gpu_step: {name}, torch {torch.__version__}, peak bf16 {peak_tflops(name)} TFLOP/s; {seqs} "
            f"sequences of {prompt} + {response} tokens\n{HEADER}")


def run_shape(shape: str, seqs: int, micro: int, prompt: int, response: int, kernels: list[str], steps: int,
              budget: str | int | None = None, checkpointing: bool = False, fsdp: bool = False,
              offload: bool = False, hand: bool = True, reference: list[str] | None = None) -> list[Row]:
    """Every row of one model shape (module docstring), printed as they come; the reference's forward with the
    kernels `reference` (default: each of `kernels`)."""
    config = SHAPES[shape]
    data = make_batch(seqs, prompt, response, config["vocab_size"])
    peak = peak_tflops(torch.cuda.get_device_name())
    rows: list[Row] = []

    def emit(row: Row) -> None:
        rows.append(row)
        print(row.line(), flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        total, layer_params = write_model(Path(tmp), config)
        setup = Setup(shape, tmp, seqs, micro, prompt, response, steps, checkpointing, fsdp, offload)
        lengths = [prompt + response] * seqs
        distrl_flops = step_flops(config, layer_params, lengths, seqs * response).total / 1e12
        hand_flops = step_flops(config, layer_params, lengths, seqs * (prompt + response - 1)).total / 1e12
        hand_seconds = None
        if hand:
            with _freed(f"hand-written ({total / 1e9:.2f}B)", shape, emit):
                row = hand_row(setup, data, f"hand-written ({total / 1e9:.2f}B, {seqs} x {micro})")
                hand_seconds = row.seconds
                emit(_rated(row, hand_flops, peak, setup.tokens, hand_seconds))
        for kernel, tokens_budget in [(k, None) for k in kernels] + ([(kernels[0], budget)] if budget else []):
            what = f"distrl {kernel}" + (f", budget {tokens_budget}" if tokens_budget else f", {seqs} x {micro}")
            if kernel == "liger" and liger_problem():
                emit(Row(shape, what, note=f"skipped: {liger_problem()}"))
                continue
            with _freed(what, shape, emit):
                emit(_rated(distrl_row(setup, data, what, kernel, tokens_budget), distrl_flops, peak, setup.tokens,
                            hand_seconds))
            if tokens_budget is None and kernel in (kernels if reference is None else reference):
                with _freed(f"reference forward {kernel}", shape, emit):
                    emit(_rated(reference_row(setup, data, kernel), None, peak, setup.tokens, None))
    return rows


def _rated(row: Row, tflops: float | None, peak: float | None, tokens: int, hand_seconds: float | None) -> Row:
    """`row` with its tokens/s, MFU and ratio to the hand-written step filled in."""
    if row.seconds is not None:
        row.tokens_per_s = tokens / row.seconds
        row.mfu = tflops / row.seconds / peak if tflops and peak else None
        row.ratio = row.seconds / hand_seconds if hand_seconds else None
    return row


def hand_row(setup: Setup, data, what: str) -> Row:
    bench = HandWritten(Path(setup.directory), setup.micro, setup.prompt)
    seconds, gib, syncs = timed(lambda: bench.step(data), setup.steps)
    return Row(setup.shape, what, seconds, gib, syncs)


def distrl_row(setup: Setup, data, what: str, kernel: str, budget: str | int | None) -> Row:
    from distrl.config import FSDPStrategy, LearnerConfig, LossConfig, ModelConfig, ReplicateStrategy
    from distrl.workers.training import dist
    from distrl.workers.training.host_syncs import HostSyncs
    from distrl.workers.training.learner import Learner

    strategy = FSDPStrategy(cpu_offload=setup.offload) if setup.fsdp else ReplicateStrategy()
    cfg = LearnerConfig(dtype="bfloat16", micro_batch_size=setup.micro, lr=1e-6, kernels=kernel,
                        max_tokens_per_micro_batch=budget, gradient_checkpointing=setup.checkpointing,
                        strategy=strategy)
    learner = Learner(ModelConfig(path=setup.directory), cfg, LossConfig(), temperature=1.0,
                      norm_len=setup.response, mini_batch_size=setup.seqs, total_optimizer_steps=setup.steps + 4,
                      seed=0, num_gpus=1)
    if setup.fsdp:
        learner.connect("127.0.0.1", dist.free_port("127.0.0.1"), 0, 1)
    try:
        seconds, gib, syncs = timed(lambda: learner.update(data), setup.steps)
        with HostSyncs() as counted:
            learner.update(data)
        note = f"budget {learner.trainer.token_budget} tokens" if budget else ""
        return Row(setup.shape, what, seconds, gib, syncs, counted.total, note=note)
    finally:
        if setup.fsdp:
            learner.close()


def reference_row(setup: Setup, data, kernel: str) -> Row:
    from distrl.config import ModelConfig, ReferenceConfig
    from distrl.workers.training.reference import ReferenceWorker

    reference = ReferenceWorker(ReferenceConfig(dtype="bfloat16", micro_batch_size=setup.micro, kernels=kernel),
                                ModelConfig(path=setup.directory), temperature=1.0, num_gpus=1)
    seconds, gib, syncs = timed(lambda: reference.logprobs(data.sequences), setup.steps)
    return Row(setup.shape, f"reference forward {kernel}", seconds, gib, syncs)


@contextlib.contextmanager
def _freed(what: str, shape: str, emit: Callable[[Row], None]):
    """Run a variant; out of memory is a row of the table, not the end of the run; free the GPU after."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        emit(Row(shape, what, note=f"out of memory ({str(e).splitlines()[0][:80]})"))
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def run(seqs: int = 16, prompt: int = 256, response: int = 768, micro: int = 4, steps: int = 5,
        checkpointing: bool = False, fsdp: bool = False, shape: str = "0.5B",
        kernels: tuple[str, ...] = ("plain",)) -> dict[str, Row]:
    """The rows of one shape by what they measure (`run_shape`, after the `header`)."""
    print(header(seqs, prompt, response), flush=True)
    rows = run_shape(shape, seqs, micro, prompt, response, list(kernels), steps, checkpointing=checkpointing,
                     fsdp=fsdp)
    return {row.what.split(" (")[0].split(",")[0]: row for row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="0.5B,1.5B,3B", help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--micro", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--response", type=int, default=768)
    parser.add_argument("--kernels", default="plain,liger,compile")
    parser.add_argument("--budget", default=None, help="add a distrl row with this max_tokens_per_micro_batch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--fsdp", action="store_true", help="distrl's learner as FSDP over one rank")
    parser.add_argument("--offload", action="store_true", help="with --fsdp: parameters and AdamW state on the CPU")
    parser.add_argument("--no-hand", action="store_true", help="skip the hand-written step (e.g. 7B on one GPU)")
    parser.add_argument("--reference", default=None, help="kernels of the reference's rows (default: --kernels)")
    args = parser.parse_args()
    print(header(args.seqs, args.prompt, args.response), flush=True)
    budget = None if args.budget is None else (args.budget if args.budget == "auto" else int(args.budget))
    reference = None if args.reference is None else args.reference.split(",")
    for shape in args.shapes.split(","):
        run_shape(shape, args.seqs, args.micro, args.prompt, args.response, args.kernels.split(","), args.steps,
                  budget, args.checkpointing, args.fsdp, args.offload, hand=not args.no_hand, reference=reference)


if __name__ == "__main__":
    main()
