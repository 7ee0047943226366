"""Off-policy correction under staleness, on a task that learns: the reasoning-gym example (a warm-started tiny
Llama learns to reverse three words, `configs/reasoning-gym.yaml`), or with `--task quickstart` the quickstart's toy
task (the tiny test model, no warm start: minutes where the example's warm start alone takes several), trained by
the asynchronous loop with
`loop.max_staleness` k, with decoupled correction (old log-probs recomputed by the learners: the proximal policy;
token-level TIS into [0, 2], the config's) against none (the same proximal PPO ratio, every IS weight 1), from the
same warm start and the same seed; the synchronous loop beside them as the on-policy reference. With
`--slice-tokens N` the asynchronous arms run partial rollouts (`loop.partial_rollouts`, `loop.slice_tokens` N): a
sample's tokens may then come from several versions, each token corrected with its own behaviour log-prob.

    PYTHONPATH=. .venv/bin/python bench/bench_correction_staleness.py [--task reasoning-gym] [--steps 60]
        [--max-staleness 4] [--slice-tokens 0]
        [--arms sync,tis,none] [--seeds 0] [--warm-start-steps 2500] [--model DIR] [--set key=value ...]

Reported per arm and seed: the training reward (128 samples a step; the quickstart's 64) in windows of 10 steps,
the held-out mean reward after the last step (`eval/<set>/accuracy`: the example's 200 questions, 4 samples each
at T = 1; the quickstart's own held-out prompts), the staleness the batches had, the
update's clip share and KL to the reference; then the correction's figures by staleness (`correction/<figure>/
staleness_<age>`, averaged over the steps that held tokens of that age: ages 0 to 3 each, older ones `4+`), the
share of trained tokens of each age, and the steps at which `run.correction_alarm` (its defaults) fired, if it did.
Without a correction only the mismatch figures exist. The asynchronous arms' samples depend on which weights an
engine held when it drew them, a matter of timing: two runs of one seed are two draws, so compare arms against the
spread of their seeds. The rows of every run are written to OUT/<arm>-seed<seed>/metrics.jsonl (OUT: --out, a
temporary directory by default).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distrl.algo.correction import STALENESS_BUCKETS  # noqa: E402
from examples.reasoning_gym.run import CONFIG, DEFAULT_WARM_START_STEPS, TOKENIZER_ROWS, WARM_BATCH  # noqa: E402

TASKS = {"reasoning-gym": (CONFIG, "held_out"), "quickstart": (Path("configs/quickstart.yaml"), "toy-heldout")}
"""The config of each task, and the name of its held-out set."""
ARMS = {"sync": ["loop.mode=sync"],
        "tis": ["loop.mode=async"],  # the config's loss.correction: token-level TIS into [0, 2]
        "none": ["loop.mode=async", "loss.correction=null"]}
AGES = tuple(name for name, _, _ in STALENESS_BUCKETS)
FIGURES = ("mismatch_k3", "ess", "weight_min", "weight_max", "frac_truncated")
WINDOW = 10


def warm_started(model: Path, steps: int, seed: int) -> Path:
    """The example's warm start (`examples/reasoning_gym/run.py`), made once into `model` and reused after (its
    `warm_start.json`, written last, says it is complete)."""
    done = model / "warm_start.json"
    if done.exists():
        print(f"warm start: reusing {model} ({done.read_text().strip()})")
        return model
    from distrl import config
    from distrl.standards import reasoning_gym
    from examples.reasoning_gym.warm_start import build_model, warm_start

    cfg = config.load(ROOT / CONFIG)
    rows = reasoning_gym.rows(**{**cfg.data.kwargs, "size": steps * WARM_BATCH})
    began = time.perf_counter()
    build_model(model, rows[:TOKENIZER_ROWS], seed)
    losses = warm_start(model, rows, steps, seed, batch_size=WARM_BATCH)
    print(f"warm start: {steps} steps in {time.perf_counter() - began:.0f} s, loss {losses[0]:.2f} -> "
          f"{losses[-1]:.2f}, into {model}")
    done.write_text(json.dumps({"steps": steps, "seed": seed, "loss": [losses[0], losses[-1]]}) + "\n")
    return model


def run(task: str, out: Path, name: str, model: Path, steps: int, seed: int, overrides: list[str],
        local: bool = False) -> list[dict]:
    from distrl import config
    from distrl.driver import train

    cfg = config.load(ROOT / TASKS[task][0], [
        f"model.path={model}", f"run.output_dir={out}", f"run.name={name}", f"run.steps={steps}", f"run.seed={seed}",
        "run.progress=false", "run.log_every=10", "run.checkpoint_at_end=false", "run.samples_every=0",
        f"eval.every={steps}", *overrides])  # held out once, after the last step
    began = time.perf_counter()
    if local:  # every role in this process, an HF-sampling engine (tests/hf_rollout.py): no Ray, no vLLM
        from tests.hf_rollout import HFRolloutWorker

        train(cfg, rollout_worker=HFRolloutWorker)
    else:
        train(cfg)
    print(f"{name}: {steps} steps in {time.perf_counter() - began:.0f} s")
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def fired(rows: list[dict]) -> str:
    """The steps at which each alarm's count of ages past its bound rose (the run warns at the first, once per
    figure and age), or `none`."""
    out = []
    for key in ("health/correction_ess_low", "health/correction_truncated_high"):
        steps = [r["step"] for i, r in enumerate(rows)
                 if (r.get(key) or 0) > (rows[i - 1].get(key) or 0 if i else 0)]
        if steps:
            out.append(f"{key.removeprefix('health/correction_')} at {steps}")
    return ", ".join(out) or "none"


def report(runs: dict[str, list[dict]], steps: int, held_out_set: str) -> None:
    print(f"\ntraining reward, mean per {WINDOW} steps; held-out mean reward after step {steps}")
    print(f"{'run':<14}" + "".join(f"{f'{i + 1}-{min(i + WINDOW, steps)}':>9}" for i in range(0, steps, WINDOW))
          + f"{'held-out':>10}{'stale mean':>11}{'max':>5}{'clip':>8}{'kl/ref':>9}")
    for name, rows in runs.items():
        rewards = [r["reward/mean"] for r in rows]
        windows = [statistics.fmean(rewards[i:i + WINDOW]) for i in range(0, len(rewards), WINDOW)]
        held_out = rows[-1].get(f"eval/{held_out_set}/accuracy")
        print(f"{name:<14}" + "".join(f"{w:>9.3f}" for w in windows)
              + f"{held_out if held_out is not None else float('nan'):>10.3f}"
              + f"{mean_of(rows, 'staleness/mean') or 0.0:>11.2f}{max(r['staleness/max'] for r in rows):>5.0f}"
              + f"{mean_of(rows, 'clip/frac') or 0.0:>8.4f}{mean_of(rows, 'kl/ref') or 0.0:>9.5f}")
    print("\nshare of trained tokens by age, mean over steps; versions one sample spans, mean and max over steps")
    print(f"{'run':<14}" + "".join(f"{f'age {a}':>9}" for a in AGES) + f"{'spanned':>9}{'max':>5}")
    for name, rows in runs.items():
        shares = [mean_of(rows, f"tokens/age_{a}_share") or 0.0 for a in AGES]
        spanned = mean_of(rows, "tokens/versions_spanned_mean") or 1.0
        most = max(r.get("tokens/versions_spanned_max", 1.0) for r in rows)
        print(f"{name:<14}" + "".join(f"{s:>9.3f}" for s in shares) + f"{spanned:>9.2f}{most:>5.0f}")
    print("\ncorrection by staleness, mean over the steps holding tokens of that age (steps: how many)")
    print(f"{'run':<14}{'age':>4}{'steps':>6}" + "".join(f"{f:>15}" for f in FIGURES))
    for name, rows in runs.items():
        for age in AGES:
            held = [r for r in rows if r.get(f"correction/mismatch_k3/staleness_{age}") is not None]
            if not held:
                continue
            cells = [mean_of(held, f"correction/{f}/staleness_{age}") for f in FIGURES]
            print(f"{name:<14}{age:>4}{len(held):>6}"
                  + "".join(f"{'-':>15}" if c is None else f"{c:>15.3g}" for c in cells))
        print(f"{'':<14}alarms: {fired(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", choices=list(TASKS), default="reasoning-gym")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--max-staleness", type=int, default=4, help="loop.max_staleness of the asynchronous arms")
    parser.add_argument("--slice-tokens", type=int, default=0,
                        help="partial rollouts in the asynchronous arms, N tokens a slice (0: off)")
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)}")
    parser.add_argument("--seeds", default="0", help="run seeds, comma-separated")
    parser.add_argument("--warm-start-steps", type=int, default=DEFAULT_WARM_START_STEPS)
    parser.add_argument("--model", type=Path, default=ROOT / "artifacts" / "reasoning-gym" / "warm-start",
                        help="reasoning-gym's warm-started model: made here if absent, reused if present")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--local", action="store_true",
                        help="cluster.backend local with tests/hf_rollout.py's HF-sampling engine: no Ray, no vLLM")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    arms = args.arms.split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        parser.error(f"--arms: unknown {unknown}")
    out = args.out or Path(tempfile.mkdtemp())
    if args.task == "quickstart":
        from distrl.workers.tiny_model import make_tiny_model

        model = make_tiny_model(out / "tiny-model")
    else:
        model = warm_started(args.model, args.warm_start_steps, seed=0)
    runs = {}
    for seed in (int(s) for s in args.seeds.split(",")):
        for arm in arms:
            staleness = [] if arm == "sync" else [f"loop.max_staleness={args.max_staleness}"]
            if arm != "sync" and args.slice_tokens:
                staleness += ["loop.partial_rollouts=true", f"loop.slice_tokens={args.slice_tokens}"]
            backend = ["cluster.backend=local", "run.ray_metrics=false"] if args.local else []
            runs[f"{arm}-seed{seed}"] = run(args.task, out, f"{arm}-seed{seed}", model, args.steps, seed,
                                            [*ARMS[arm], *staleness, *backend, *args.overrides], args.local)
            # after each run, so that a cut bench still shows what it measured
            report(runs, args.steps, TASKS[args.task][1])
    print(f"\nrows: {out}/<run>/metrics.jsonl")


if __name__ == "__main__":
    main()
