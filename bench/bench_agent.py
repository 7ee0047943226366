"""Multi-turn episodes whose tool calls take 0.2-0.5 s: the synchronous loop against the asynchronous one (k = 1)
on the same resources, in one run.

    python bench/bench_agent.py [--steps 8] [--turns 3] [--rounds 1] [--set key=value ...]

The quickstart's topology and tiny model, each episode `--turns` model turns of at most 8 tokens, every turn but
the last answered after a latency drawn from [0.2, 0.5] s (`bench/agent_env.py`). Reports per mode the steps/s
(steps 3..N: the first steps warm the engine up), the engine's busy fraction (`rollout/engine_busy_frac`: the
engine seconds of each step's episodes against the step's time), the rollout actors' idle fraction, and the ratio
of async to sync. The modes alternate, each with its own embedded Ray cluster, so they meet the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from distrl import config
from distrl.driver import train
from distrl.workers.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
MODES = {"sync": ["loop.mode=sync"], "async k=1": ["loop.mode=async", "loop.max_staleness=1"]}


def run(out: Path, name: str, model_dir: Path, args: argparse.Namespace, overrides: list[str]) -> list[dict]:
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={model_dir}", f"run.output_dir={out}", f"run.name={name}", f"run.steps={args.steps}",
        "run.progress=false", "run.log_every=1000000", "run.checkpoint_at_end=false",
        "eval=null",  # the quickstart's held-out evaluation runs after the last step too, inside its time
        "rollout.sampling.max_new_tokens=8", "env.class=agent_env:SlowTools", f"env.kwargs.turns={args.turns}",
        *overrides, *args.set])
    train(cfg)
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def summary(rows: list[dict]) -> dict[str, float]:
    timed = rows[2:]
    return {"steps_per_s": 1.0 / statistics.fmean(r["time/step"] for r in timed),
            "engine_busy": statistics.fmean(r["rollout/engine_busy_frac"] for r in timed),
            "rollout_idle": statistics.fmean(r["idle/rollout"] for r in timed),
            "env_wait_s": statistics.fmean(r["agent/env_wait_s"] for r in timed),
            "turns": statistics.fmean(r["agent/turns_mean"] for r in timed)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--set", action="append", default=[], help="extra config override, key=value")
    args = parser.parse_args()
    # The environment actors import agent_env from this directory.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "bench"), os.environ.get("PYTHONPATH")]))
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        model_dir = make_tiny_model(out / "model")
        for r in range(args.rounds):
            for mode, overrides in MODES.items():
                name = f"{mode.replace(' ', '_').replace('=', '')}_{r}"
                results[mode].append(summary(run(out, name, model_dir, args, overrides)))
                print(mode, {k: round(v, 3) for k, v in results[mode][-1].items()}, flush=True)
    print(f"\n{'mode':<10} {'steps/s':>8} {'engine busy':>12} {'rollout idle':>13} {'env wait s':>11} {'turns':>6}")
    for mode, rounds in results.items():
        m = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
        print(f"{mode:<10} {m['steps_per_s']:>8.3f} {m['engine_busy']:>12.2f} {m['rollout_idle']:>13.2f} "
              f"{m['env_wait_s']:>11.2f} {m['turns']:>6.2f}")
    ratios = [a["steps_per_s"] / s["steps_per_s"] for s, a in zip(results["sync"], results["async k=1"], strict=True)]
    print(f"\nasync / sync steps/s: {statistics.median(ratios):.2f}x (per round: "
          + ", ".join(f"{x:.2f}" for x in ratios) + ")")


if __name__ == "__main__":
    main()
