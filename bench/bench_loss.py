"""Time of distrl's `compute_loss` (forward + backward + every metric on the host) against OpenRLHF's `PolicyLoss`.

The comparison, `openrlhf_policy_loss`, transcribes the forward of OpenRLHF's `PolicyLoss` (openrlhf/models/loss.py,
as documented in shared/references/openrlhf-policy-loss.txt; read at commit 3c3be62) op for op for the options
measured here: policy_loss_type "ppo", clip_eps_low = clip_eps_high = 0.2, no dual clip, vLLM IS correction "tis"
with threshold [0.5, 5.0] (its README's example), token-level loss without global token count (masked_mean), and
its three metrics clip_ratio, ppo_kl, vllm_kl. OpenRLHF is not installed here; autograd gives its backward.
distrl runs `compute_loss` with the same options (LossConfig: ppo, token_mean, correction tis token [0.5, 5.0]) and
reports its 13 metrics; `reference_loss` (the plain composition that compute_loss was before it was fused, and that
it still equals bit for bit) is timed too.

Inputs: `[B, T]` float32 on one device, a ragged right-padded mask (lengths uniform in [T/8, T]), log-probs drifted
from old by 0.1 and rollout log-probs by 0.05 (so some ratios clip and some weights truncate), one advantage per
sequence. Each variant runs on the same tensors (a fresh leaf for logprobs), interleaved round by round in rotating
order, and reads its metrics to the host in one copy; the figures are medians over rounds of wall time and of this
thread's CPU time (the second does not count time the scheduler gave to other processes, which on a shared machine
dominates wall-time noise). Default 1 intra-op thread: on a loaded 2-core machine OpenMP threads spin-wait on
descheduled siblings (a 30 us add measured 12 ms at 2 threads).

    python bench/bench_loss.py [--batch 64] [--length 2048] [--rounds 40] [--threads 1] [--device cpu] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable

import torch

from distrl.algo import LossInputs, compute_loss, reference_loss
from distrl.config import LossConfig, PPOConfig, RatioCorrection

CLIP, TIS_LOW, TIS_HIGH = 0.2, 0.5, 5.0


def openrlhf_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                         action_mask: torch.Tensor, rollout_log_probs: torch.Tensor,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """OpenRLHF `PolicyLoss.forward` for ppo + token TIS + token-level loss: (loss, clip_ratio, ppo_kl, vllm_kl)."""
    def masked_mean(x: torch.Tensor) -> torch.Tensor:
        return (x * action_mask).sum() / action_mask.sum()

    raw_log_ratio = log_probs - old_log_probs
    ratio = raw_log_ratio.clamp(min=-20.0, max=20.0).exp()
    surr1 = ratio * advantages
    surr2 = ratio.clamp(1 - CLIP, 1 + CLIP) * advantages
    loss = -torch.min(surr1, surr2)
    vllm_is = torch.exp(old_log_probs - rollout_log_probs).clamp(min=TIS_LOW, max=TIS_HIGH).detach()
    loss = vllm_is * loss
    vllm_kl = masked_mean(rollout_log_probs - old_log_probs)
    loss = masked_mean(loss)
    clip_ratio = masked_mean(torch.lt(surr2, surr1).float())
    ppo_kl = masked_mean(-raw_log_ratio.detach())
    return loss, clip_ratio, ppo_kl, vllm_kl


def make_inputs(b: int, t: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(t // 8, t + 1, (b,), generator=g)
    mask = (torch.arange(t) < lengths[:, None]).float()
    old = -torch.rand(b, t, generator=g) * 3 - 0.1
    tensors = {"logprobs": old + 0.1 * torch.randn(b, t, generator=g), "old_logprobs": old,
               "advantages": torch.randn(b, 1, generator=g).expand(b, t).contiguous(), "mask": mask,
               "rollout_logprobs": old + 0.05 * torch.randn(b, t, generator=g)}
    return {name: (x * mask).to(device) for name, x in tensors.items()}  # 0 on padding, as a learner passes them


CFG = LossConfig(policy=PPOConfig(clip_low=CLIP, clip_high=CLIP, aggregation="token_mean"),
                 correction=RatioCorrection(mode="tis", level="token", low=TIS_LOW, high=TIS_HIGH))


def variants(x: dict[str, torch.Tensor]) -> dict[str, Callable[[], float]]:
    """Each variant: forward, backward, metrics on the host; returns the loss."""
    def leaf() -> torch.Tensor:
        return x["logprobs"].detach().clone().requires_grad_()

    def inputs(lp: torch.Tensor) -> LossInputs:
        return LossInputs(logprobs=lp, old_logprobs=x["old_logprobs"], advantages=x["advantages"], mask=x["mask"],
                          rollout_logprobs=x["rollout_logprobs"])

    def openrlhf() -> float:
        loss, *metrics = openrlhf_policy_loss(leaf(), x["old_logprobs"], x["advantages"], x["mask"],
                                              x["rollout_logprobs"])
        loss.backward()
        torch.stack([m.detach() for m in metrics]).tolist()
        return loss.item()

    def distrl() -> float:
        out = compute_loss(inputs(leaf()), CFG)  # its metrics come back as floats (one host copy)
        out.loss.backward()
        return out.loss.item()

    def reference() -> float:
        loss, metrics = reference_loss(inputs(leaf()), CFG)
        loss.backward()
        torch.stack(list(metrics.values())).tolist()
        return loss.item()

    return {"openrlhf": openrlhf, "distrl": distrl, "reference": reference}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(fns: dict[str, Callable[[], float]], rounds: int, device: str) -> dict[str, dict[str, float]]:
    names = list(fns)
    wall: dict[str, list[float]] = {n: [] for n in names}
    cpu: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 3):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _sync(device)
            w0, c0 = time.perf_counter(), time.thread_time()
            fns[name]()
            _sync(device)
            if r >= 3:  # warm-up rounds
                wall[name].append(time.perf_counter() - w0)
                cpu[name].append(time.thread_time() - c0)
    return {n: {"wall_ms": statistics.median(wall[n]) * 1e3, "cpu_ms": statistics.median(cpu[n]) * 1e3}
            for n in names}


_NO_PASS = {"aten::view", "aten::detach", "aten::as_strided", "aten::expand", "aten::unsqueeze", "aten::flatten",
            "aten::alias", "aten::empty_like", "aten::empty_strided", "aten::empty", "aten::select", "aten::slice",
            "aten::squeeze", "aten::reshape", "aten::result_type", "aten::lift_fresh", "aten::to"}


def profile(fn: Callable[[], float], shape: tuple[int, int], runs: int = 5) -> None:
    """Where one forward + backward spends its time: the ops that read or write a `[B, T]` tensor (one pass each:
    the outermost aten op, views left out) and the costliest ops, over `runs` calls after a warm-up."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    with torch_profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(runs):
            fn()
    passes: Counter[str] = Counter()
    for event in prof.events():
        parent = event.cpu_parent
        outermost = parent is None or not parent.name.startswith("aten::") or parent.name in _NO_PASS
        over_bt = any(list(s) == list(shape) for s in event.input_shapes or [])
        if event.name.startswith("aten::") and event.name not in _NO_PASS and outermost and over_bt:
            passes[event.name] += 1
    per_run = {name: n // runs for name, n in passes.most_common()}
    print(f"  passes over [B, T] per call: {sum(per_run.values())}: {per_run}")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=40)
    print("\n".join("  " + line for line in table.splitlines()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", action="store_true", help="print where each variant's time goes, then stop")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x = make_inputs(args.batch, args.length, args.device)
    fns = variants(x)
    losses = {name: fn() for name, fn in fns.items()}
    print(f"B={args.batch} T={args.length} valid tokens={int(x['mask'].sum())} device={args.device} "
          f"threads={torch.get_num_threads()} torch={torch.__version__}")
    print(f"loss: distrl {losses['distrl']:.9g}  reference {losses['reference']:.9g}  "
          f"openrlhf {losses['openrlhf']:.9g}")
    if args.profile:
        for name, fn in fns.items():
            print(f"{name}:")
            profile(fn, (args.batch, args.length))
        return
    result = measure(fns, args.rounds, args.device)
    for name, r in result.items():
        print(f"{name:10s} wall {r['wall_ms']:8.2f} ms   cpu {r['cpu_ms']:8.2f} ms")
    for other in ("openrlhf", "reference"):
        print(f"distrl / {other}: wall {result['distrl']['wall_ms'] / result[other]['wall_ms']:.2f}x   "
              f"cpu {result['distrl']['cpu_ms'] / result[other]['cpu_ms']:.2f}x")


if __name__ == "__main__":
    main()
