"""What evaluation during training costs: the quickstart with and without its held-out evaluation, in the
synchronous and the asynchronous loop, in one run.

    python bench/bench_eval.py [--steps 20] [--every 5] [--n 4] [--set key=value ...]

For each loop: steps/s over steps 2..N without `eval`, then with the quickstart's held-out set (64 prompts, n
samples each) evaluated every `every` steps; the time an evaluation takes (`time/eval`), and what it adds to the
steps it runs in. In the asynchronous loop the engines go on with training chunks while an evaluation runs, so
part of its cost is hidden. The runs share this process and machine one after another: compare the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from distrl import config
from distrl.driver import train

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, name: str, steps: int, overrides: list[str]) -> list[dict]:
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"model.path={out / 'tiny-model'}", f"run.output_dir={out}", f"run.name={name}", f"run.steps={steps}",
        "run.progress=false", "run.log_every=1000000", "run.checkpoint_at_end=false", "run.samples_every=0",
        *overrides])
    train(cfg)
    return [json.loads(line) for line in (out / name / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--n", type=int, default=4, help="samples per held-out prompt")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        print(f"{'loop':<7}{'eval':<22}{'step s':>8}{'steps/s':>9}{'vs none':>9}{'eval s':>8}"
              f"{'eval step s':>13}{'other step s':>14}")
        for loop in ("sync", "async"):
            base = None
            for label, evaluation in (("none", ["eval=null"]),
                                      (f"every {args.every}, n {args.n}",
                                       [f"eval.every={args.every}", f"eval.sampling.n={args.n}",
                                        "eval.sampling.temperature=1.0"])):
                rows = run(out, f"{loop}-{label.split(',')[0].replace(' ', '')}", args.steps,
                           [f"loop.mode={loop}", *evaluation, *args.overrides])[1:]
                seconds = sum(r["time/step"] for r in rows)
                steps_per_s = len(rows) / seconds
                base = base or steps_per_s
                evaluated = [r for r in rows if "time/eval" in r]
                others = [r["time/step"] for r in rows if "time/eval" not in r]
                eval_s = statistics.fmean(r["time/eval"] for r in evaluated) if evaluated else 0.0
                eval_step = statistics.fmean(r["time/step"] for r in evaluated) if evaluated else 0.0
                print(f"{loop:<7}{label:<22}{seconds / len(rows):>8.3f}{steps_per_s:>9.3f}"
                      f"{steps_per_s / base:>8.2f}x{eval_s:>8.2f}{eval_step:>13.2f}"
                      f"{statistics.fmean(others):>14.3f}", flush=True)


if __name__ == "__main__":
    main()
