"""Synchronous against asynchronous training, on the same config and resources, in one run.

    python bench/bench_async.py [--steps 8] [--hidden 512 --layers 8] [--curve-steps 30] [--modes sync,...]
        [--set key=value ...]

1. Throughput: the quickstart config on a bigger random model (by default ~25M parameters, where generation and
   training take comparable time), run with `loop.mode: sync`, then `async` with max_staleness 1 and 2. Reports
   steps/s and tokens/s (steps 2..N, the first step warms the engines up), the ratio to sync, and each role's idle
   fraction; and the same in hybrid mode (`cluster.colocate: hybrid`: the engine and the reference inside the
   learner's actor), synchronous and one step off.
2. Learning: the quickstart itself (tiny model, toy task) in each mode: reward against samples consumed.

The modes run one after another in this process, each with its own embedded Ray cluster, so they meet the same
machine; compare the ratios, not the absolute figures, across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from distrl import config
from distrl.driver import train
from distrl.workers.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": ["loop.mode=sync"],
         "async k=1": ["loop.mode=async", "loop.max_staleness=1"],
         "async k=2": ["loop.mode=async", "loop.max_staleness=2"],
         "hybrid sync": ["loop.mode=sync", "cluster.colocate=hybrid"],
         "hybrid k=1": ["loop.mode=async", "loop.max_staleness=1", "cluster.colocate=hybrid"]}


def quickstart(out: Path, name: str, model_dir: Path, steps: int, overrides: list[str]) -> config.Config:
    return config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={model_dir}", f"run.output_dir={out}", f"run.name={name}", f"run.steps={steps}",
        "run.progress=false", "run.log_every=1000000", "run.checkpoint_at_end=false",
        "eval=null",  # the quickstart's held-out evaluation runs after the last step too, inside its time
        *overrides])


def run(out: Path, name: str, model_dir: Path, steps: int, overrides: list[str]) -> list[dict]:
    train(quickstart(out, name, model_dir, steps, overrides))
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def throughput(out: Path, args: argparse.Namespace) -> None:
    model_dir = make_tiny_model(out / "big-model", hidden_size=args.hidden, num_layers=args.layers)
    results = {}
    for mode, overrides in args.modes.items():
        rows = run(out, "throughput-" + mode.replace(" ", "").replace("=", ""), model_dir, args.steps,
                   [*overrides, *args.overrides])[1:]
        seconds = sum(r["time/step"] for r in rows)
        tokens = sum(r["throughput/tokens_per_s"] * r["time/step"] for r in rows)
        results[mode] = {"steps_per_s": len(rows) / seconds, "tokens_per_s": tokens / seconds,
                         "step_s": seconds / len(rows),
                         **{k: statistics.fmean(r.get(k) or 0.0 for r in rows)
                            for k in ("idle/rollout", "idle/learner", "idle/reference", "staleness/mean",
                                      "staleness/max", "samples/dropped_stale")}}
    base = next(iter(results.values()))["steps_per_s"]
    print(f"\nthroughput: model hidden {args.hidden}, layers {args.layers}; steps 2..{args.steps}")
    print(f"{'mode':<12}{'step s':>8}{'steps/s':>9}{'tokens/s':>10}{'vs first':>9}{'idle rollout':>14}"
          f"{'idle learner':>14}{'idle ref':>10}{'stale mean':>12}{'dropped':>9}")
    for mode, r in results.items():
        print(f"{mode:<12}{r['step_s']:>8.2f}{r['steps_per_s']:>9.3f}{r['tokens_per_s']:>10.0f}"
              f"{r['steps_per_s'] / base:>8.2f}x{r['idle/rollout']:>14.1%}{r['idle/learner']:>14.1%}"
              f"{r['idle/reference']:>10.1%}{r['staleness/mean']:>12.2f}{r['samples/dropped_stale']:>9.0f}")


def learning(out: Path, args: argparse.Namespace) -> None:
    model_dir = make_tiny_model(out / "tiny-model")
    curves = {mode: run(out, "curve-" + mode.replace(" ", "").replace("=", ""), model_dir, args.curve_steps,
                        [*overrides, *args.overrides])
              for mode, overrides in args.modes.items()}
    window = 5
    print(f"\nlearning: quickstart task, tiny model; mean reward per {window} steps "
          f"(samples consumed = step x batch)")
    batch = quickstart(out, "x", model_dir, 1, args.overrides).global_batch_size
    for mode, rows in curves.items():
        means = [statistics.fmean(r["reward/mean"] for r in rows[i : i + window]) for i in range(0, len(rows), window)]
        print(f"{mode:<12}" + " ".join(f"{m:.3f}" for m in means)
              + f"   (wall {sum(r['time/step'] for r in rows):.1f} s)")
    print(f"{'samples':<12}" + " ".join(f"{(i + window) * batch:>5}" for i in range(0, args.curve_steps, window)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--curve-steps", type=int, default=30)
    ap.add_argument("--skip-curve", action="store_true")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    unknown = [m for m in args.modes.split(",") if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}")
    args.modes = {m: MODES[m] for m in args.modes.split(",")}
    out = Path(tempfile.mkdtemp())
    throughput(out, args)
    if not args.skip_curve:
        learning(out, args)


if __name__ == "__main__":
    main()
