"""Learner and reference time with and without padding: update + old log-probs + reference log-probs on one batch
whose responses vary 4x in length, padded forward passes in fixed micro-batches against packed ones by a token
budget, interleaved in one run.

    python bench/bench_learner_step.py [--hidden 512 --layers 8] [--batch 64] [--response 32 128] [--prompt 16 48]
                                       [--skew 1] [--micro 32] [--max-tokens 2048] [--rounds 3]

Response lengths are `lo + (hi - lo) * u ** skew` for u uniform on [0, 1]: `--skew 1` spreads them evenly over the
range, `--skew 2` makes most responses short and a few long (mean a third of the way up), as RL responses often are.

"padded" is the forward pass distrl ran before packing (`padded_response_logprobs`, swapped in for
`response_logprobs`) with `micro_batch_size` rows per micro-batch, as in the quickstart config; "packed" is
today's `response_logprobs` with `max_tokens_per_micro_batch`. Both learners start from the same weights and train
on the same batch; the reference is the same frozen model. Each round times both, in alternating order, so load
from other processes falls on both; the summary takes the median round.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from distrl.config import LearnerConfig, LossConfig, ModelConfig, ReferenceConfig
from distrl.types.batches import Sequences, TrainBatch
from distrl.workers.tiny_model import make_tiny_model
from distrl.workers.training import learner as learner_module
from distrl.workers.training import model as model_module
from distrl.workers.training.learner import Learner
from distrl.workers.training.reference import ReferenceWorker


def mixed_batch(b: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int, seed: int,
                skew: float = 1.0) -> TrainBatch:
    """`b` rows, prompt lengths uniform over `prompt`, response lengths `lo + (hi - lo) * u ** skew` over
    `response` (left/right padded)."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(prompt[0], prompt[1] + 1, (b,), generator=g).tolist()
    u = torch.rand(b, generator=g, dtype=torch.float64) ** skew
    response_lens = (response[0] + (response[1] - response[0]) * u).round().long().tolist()
    p, t = max(prompt_lens), max(response_lens)
    attention = torch.zeros(b, p + t, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        attention[i, p - pl : p + rl] = 1
    mask = attention[:, p:].float()
    seqs = Sequences(input_ids=torch.randint(10, vocab, (b, p + t), generator=g) * attention,
                     attention_mask=attention, response_mask=mask,
                     rollout_logprobs=-torch.rand(b, t, generator=g) * mask,
                     policy_version=torch.zeros(b, dtype=torch.long),
                     response_versions=torch.zeros(b, t, dtype=torch.long))
    advantages = (torch.randn(b, 1, generator=g) * mask).contiguous()
    return TrainBatch(seqs, old_logprobs=None, advantages=advantages, ref_logprobs=None)


def padded_logprobs(model, batch: Sequences, temperature: float, with_entropy: bool = False, layout=None):
    """`padded_response_logprobs` with `response_logprobs`' arguments: the packed pass's `layout` is not needed."""
    return model_module.padded_response_logprobs(model, batch, temperature, with_entropy)


@contextlib.contextmanager
def padded_forward() -> Iterator[None]:
    """The padded forward pass in place of the packed one, in the learner and in `score_in_micro_batches`."""
    packed = model_module.response_logprobs
    learner_module.response_logprobs = model_module.response_logprobs = padded_logprobs
    try:
        yield
    finally:
        learner_module.response_logprobs = model_module.response_logprobs = packed


def timed_step(reference: ReferenceWorker, learner: Learner, batch: TrainBatch) -> dict[str, float]:
    """Seconds in the three phases of a synchronous step that run the policy or reference model."""
    times = {}
    start = time.perf_counter()
    ref = reference.logprobs(batch.sequences)
    times["reference"] = time.perf_counter() - start
    start = time.perf_counter()
    old = learner.logprobs(batch.sequences)
    times["old_logprobs"] = time.perf_counter() - start
    start = time.perf_counter()
    learner.update(replace(batch, old_logprobs=old, ref_logprobs=ref))
    times["update"] = time.perf_counter() - start
    times["total"] = sum(times.values())
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt", type=int, nargs=2, default=(16, 48))
    ap.add_argument("--response", type=int, nargs=2, default=(32, 128))
    ap.add_argument("--skew", type=float, default=1.0, help="1: response lengths uniform; 2: most short")
    ap.add_argument("--micro", type=int, default=32, help="micro_batch_size of the padded runs")
    ap.add_argument("--max-tokens", type=int, default=2048, help="max_tokens_per_micro_batch of the packed runs")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "model", hidden_size=args.hidden, num_layers=args.layers)
    model = ModelConfig(path=str(model_dir))
    loss = LossConfig.model_validate({"kl": {"coef": 0.001, "estimator": "k3", "target": "loss"},
                                      "correction": {"mode": "tis", "low": 0.0, "high": 2.0}})
    settings = {"padded": {"micro_batch_size": args.micro},
                "packed": {"micro_batch_size": args.micro, "max_tokens_per_micro_batch": args.max_tokens}}
    roles = {}
    for name, micro in settings.items():
        learner = Learner(model, LearnerConfig(lr=1e-5, **micro), loss, temperature=1.0, norm_len=args.response[1],
                          mini_batch_size=args.batch, total_optimizer_steps=args.rounds + 1, seed=0)
        roles[name] = (ReferenceWorker(ReferenceConfig(**micro), model, temperature=1.0), learner)
    n_params = sum(p.numel() for p in roles["packed"][1].model.parameters())
    batch = mixed_batch(args.batch, args.prompt, args.response, len(roles["packed"][1].model.get_input_embeddings()
                                                                    .weight), seed=0, skew=args.skew)
    real = int(batch.sequences.attention_mask.sum())
    print(f"model: hidden {args.hidden}, layers {args.layers}, {n_params / 1e6:.1f}M parameters, float32, "
          f"{torch.get_num_threads()} threads; batch {args.batch} rows, prompts {args.prompt[0]}-{args.prompt[1]} "
          f"and responses {args.response[0]}-{args.response[1]} tokens (skew {args.skew:g}): {real} real tokens in "
          f"{batch.sequences.input_ids.numel()} padded ({batch.sequences.input_ids.numel() / real:.2f}x)")
    print(f"padded: micro_batch_size {args.micro}; packed: max_tokens_per_micro_batch {args.max_tokens}")
    timed_step(*roles["packed"], batch)  # warm-up (allocator, first-call costs), not counted
    with padded_forward():
        timed_step(*roles["padded"], batch)
    results: dict[str, list[dict[str, float]]] = {"padded": [], "packed": []}
    for r in range(args.rounds):
        for name in ("padded", "packed") if r % 2 == 0 else ("packed", "padded"):
            with padded_forward() if name == "padded" else contextlib.nullcontext():
                results[name].append(timed_step(*roles[name], batch))
    print(f"{'seconds (median of ' + str(args.rounds) + ')':<26}{'padded':>10}{'packed':>10}{'ratio':>8}")
    for phase in ("reference", "old_logprobs", "update", "total"):
        a, b = (statistics.median(t[phase] for t in results[name]) for name in ("padded", "packed"))
        print(f"{phase:<26}{a:>10.2f}{b:>10.2f}{a / b:>7.2f}x")
    ratios = [p["total"] / q["total"] for p, q in zip(results["padded"], results["packed"], strict=True)]
    print("total ratio per round: " + ", ".join(f"{x:.2f}x" for x in ratios))


if __name__ == "__main__":
    main()
