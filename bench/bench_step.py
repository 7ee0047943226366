"""Step-time breakdown of a real run (Ray + vLLM CPU + learner), weight-sync time and bytes/s, and the driver's
own overhead as a fraction of step time.

    python bench/bench_step.py [--steps 8] [--hidden 128 --layers 2] [--set key=value ...]

Runs the quickstart config (tiny model, optionally bigger via --hidden/--layers) and summarises metrics.jsonl,
skipping the first step (engine warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from distrl import config
from distrl.driver import train
from distrl.run_dir import DRIVER_PHASES
from distrl.workers.tiny_model import make_tiny_model

NOT_WAITS = {"time/step", "time/elapsed", "time/driver_overhead", *DRIVER_PHASES}
"""Every other `time/*` key is a phase in which the driver waits for actors or reward tasks; the rest of a step is
`driver_overhead` (batching, advantages, metrics, logging, progress bar), of which `advantages` is timed apart."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp())
    model_dir = make_tiny_model(out / "model", hidden_size=args.hidden, num_layers=args.layers)
    cfg = config.load(Path(__file__).parents[1] / "configs" / "quickstart.yaml", [
        f"model.path={model_dir}", f"run.output_dir={out}", f"run.steps={args.steps}", "run.progress=false",
        "run.checkpoint_at_end=false",
        "eval=null",  # the quickstart's held-out evaluation runs after the last step too, inside its time
        *args.overrides])
    train(cfg)
    rows = [json.loads(line) for line in (out / cfg.run.name / "metrics.jsonl").read_text().splitlines()][1:]
    step = statistics.fmean(r["time/step"] for r in rows)
    print(f"\nmodel: hidden {args.hidden}, layers {args.layers}; {cfg.cluster.rollout.num_actors} rollout x "
          f"{cfg.cluster.learner.num_actors} learner; batch {cfg.global_batch_size} sequences; steps 2..{args.steps}")
    print(f"{'phase':<18}{'seconds':>10}{'share':>9}")
    waits = list(dict.fromkeys(k for r in rows for k in r if k.startswith("time/") and k not in NOT_WAITS))
    for key in (*waits, "time/driver_overhead"):
        t = statistics.fmean(r.get(key, 0.0) for r in rows)
        print(f"{key.removeprefix('time/'):<18}{t:>10.3f}{t / step:>9.1%}")
    adv = statistics.fmean(r["time/advantages"] for r in rows)
    print(f"{'  advantages':<18}{adv:>10.3f}{adv / step:>9.1%}   (part of driver_overhead)")
    print(f"{'step':<18}{step:>10.3f}")
    # Batch tokens over the driver's wait for them: the engines' rate in the synchronous loop. In the asynchronous
    # one generation overlaps the update, so this is not the engines' rate, and a row whose batch was ready
    # without a wait has none: the mean is over the rows that waited.
    waited = [r["rollout/tokens_per_s"] for r in rows if r["rollout/tokens_per_s"] is not None]
    print(f"rollout tokens/s (generate phase): {statistics.fmean(waited):.0f}" if waited else
          "rollout tokens/s (generate phase): n/a (no step waited for its batch)")
    print(f"throughput tokens/s (whole step):  {statistics.fmean(r['throughput/tokens_per_s'] for r in rows):.0f}")
    # A push lasts from its start until every engine serves the new weights; the driver waits for all of it in the
    # synchronous loop (time/sync), only for its start in the asynchronous one, where each engine takes the
    # weights after the chunk it is generating.
    sync_bytes = next(r["sync/bytes"] for r in rows if r["sync/bytes"] is not None)
    rate = statistics.fmean(r["sync/bytes_per_s"] for r in rows if r["sync/bytes_per_s"])
    print(f"weight sync: {sync_bytes / 2**20:.2f} MiB a push, {sync_bytes / rate:.3f} s until every engine served "
          f"it ({rate / 2**20:.1f} MiB/s); the driver waited {statistics.fmean(r['time/sync'] for r in rows):.3f} s")
    # Step times add up to the run's wall time (a step's logging is counted in the next step), so the overhead
    # share is the driver's own work against everything the run spent.
    overhead = statistics.fmean(r["time/driver_overhead"] for r in rows)
    print(f"driver overhead: {overhead * 1e3:.1f} ms of {step * 1e3:.0f} ms per step = {overhead / step:.2%} "
          f"of step time")

if __name__ == "__main__":
    main()
