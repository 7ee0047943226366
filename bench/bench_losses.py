"""Each policy loss's `compute_loss` (forward + backward + every metric on the host) against PPO's, on the same batch.

The batch and the options are `bench_loss.py`'s (B=64, T=2048 float32, lengths uniform in [T/8, T], log-probs
drifted from old by 0.1, token TIS [0.5, 5.0], one advantage per sequence), with each `loss.policy.type` at its
defaults but for the clip ranges of CISPO (0.2, 0.2, so that weights clip on this batch) and the covariance
fractions (the papers': Clip-Cov 2e-4 of the tokens, KL-Cov 2e-3). The covariance losses' selection
(`covariance_selection`) is made once per optimizer step by the driver, not by the loss: it is timed on its own.
`reference` is each type's plain composition under autograd (`reference_loss`), which the fused path equals.
Variants are interleaved round by round in rotating order; figures are medians of wall time and of this thread's CPU
time (which leaves out the time the scheduler gave other processes on a shared machine), and ratios to PPO's.

    python bench/bench_losses.py [--batch 64] [--length 2048] [--rounds 30] [--threads 1] [--device cpu]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_loss import make_inputs, measure

from distrl.algo import LossInputs, compute_loss, covariance_selection, reference_loss
from distrl.config import (
    CISPOConfig,
    ClipCovConfig,
    GMPOConfig,
    GPGConfig,
    GSPOConfig,
    KLCovConfig,
    LossConfig,
    PolicyConfig,
    PPOConfig,
    RatioCorrection,
    SAPOConfig,
)

POLICIES: list[PolicyConfig] = [PPOConfig(), GSPOConfig(), CISPOConfig(clip_low=0.2, clip_high=0.2), SAPOConfig(),
                                GMPOConfig(), GPGConfig(), ClipCovConfig(), KLCovConfig()]
CORRECTION = RatioCorrection(mode="tis", level="token", low=0.5, high=5.0)


def variants(x: dict[str, torch.Tensor], fused: bool) -> dict[str, Callable[[], float]]:
    """Each type: forward, backward, metrics on the host (fused `compute_loss`, or `reference_loss`)."""
    selected = {p.type: covariance_selection(x["old_logprobs"], x["advantages"], x["mask"], p,
                                             torch.Generator().manual_seed(0))
                for p in POLICIES if isinstance(p, ClipCovConfig | KLCovConfig)}

    def run(policy: PolicyConfig) -> Callable[[], float]:
        cfg = LossConfig(policy=policy, correction=CORRECTION)

        def once() -> float:
            inputs = LossInputs(logprobs=x["logprobs"].detach().clone().requires_grad_(),
                                old_logprobs=x["old_logprobs"], advantages=x["advantages"], mask=x["mask"],
                                rollout_logprobs=x["rollout_logprobs"], cov_selected=selected.get(policy.type))
            if fused:
                out = compute_loss(inputs, cfg)  # its metrics come back as floats (one host copy)
                out.loss.backward()
                _ = out.metrics
                return out.loss.item()
            loss, metrics = reference_loss(inputs, cfg)
            loss.backward()
            torch.stack(list(metrics.values())).tolist()
            return loss.item()
        return once

    return {p.type: run(p) for p in POLICIES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = make_inputs(args.batch, args.length, args.device)
    print(f"B={args.batch} T={args.length} valid tokens={int(x['mask'].sum())} device={args.device} "
          f"threads={torch.get_num_threads()} torch={torch.__version__}")
    fused = measure(variants(x, fused=True), args.rounds, args.device)
    reference = measure(variants(x, fused=False), max(args.rounds // 3, 5), args.device)
    selection = measure({p.type: (lambda p=p: float(covariance_selection(
        x["old_logprobs"], x["advantages"], x["mask"], p, torch.Generator().manual_seed(0)).sum()))
        for p in POLICIES if isinstance(p, ClipCovConfig | KLCovConfig)}, args.rounds, args.device)
    ppo = fused["ppo"]
    print(f"{'type':9s} {'wall ms':>8s} {'cpu ms':>8s} {'/ ppo wall':>10s} {'/ ppo cpu':>10s}   "
          f"{'reference cpu ms':>16s} {'fused / reference cpu':>21s}")
    for name, r in fused.items():
        print(f"{name:9s} {r['wall_ms']:8.2f} {r['cpu_ms']:8.2f} {r['wall_ms'] / ppo['wall_ms']:9.2f}x "
              f"{r['cpu_ms'] / ppo['cpu_ms']:9.2f}x   {reference[name]['cpu_ms']:16.2f} "
              f"{r['cpu_ms'] / reference[name]['cpu_ms']:20.2f}x")
    for name, r in selection.items():
        print(f"selection {name}: wall {r['wall_ms']:.2f} ms  cpu {r['cpu_ms']:.2f} ms (once per optimizer step, "
              f"on the driver)")


if __name__ == "__main__":
    main()
