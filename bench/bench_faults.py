"""What a dead rollout actor costs a run: kill the engine with SIGKILL at random points of one quickstart run and
measure how long the driver takes to notice, how long until the replacement serves, and what the steps lost.

    python bench/bench_faults.py [--steps 20] [--kills 3] [--seed 0] [--loop sync|async] [--set key=value ...]

`distrl train` runs as a subprocess (embedded Ray cluster, real vLLM engine) with its output read line by line and
timestamped. After a random number of steps (1-4 since the start or the previous recovery) plus a random fraction
of a step, an engine's process (one at random, with `--set cluster.rollout.num_actors=2`) is killed. For each kill:

- detect: kill -> the driver's "rollout actor ... died" line;
- serving: kill -> the replacement's "serves policy version" line (new process, vLLM import, engine, weights);
- step: the time of the step the kill fell in, and its excess over the median step of the run, in steps;
- rows: every planned step must have its row; a missing or repeated one is a lost step.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]


class Lines:
    """The subprocess's output lines with the time each arrived, read on a thread."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, text: str, after: float) -> float | None:
        return next((t for t, line in list(self.lines) if t >= after and text in line), None)

    def rows(self) -> int:
        return sum(line.startswith("step ") for _, line in list(self.lines))


def engines(driver: int) -> list[psutil.Process]:
    def title(p: psutil.Process) -> list[str]:
        try:
            return p.cmdline()
        except psutil.Error:  # exited (or a zombie) while we looked
            return []

    return [p for p in psutil.Process(driver).children(recursive=True)
            if any(part.startswith("ray::RolloutWorker") for part in title(p))]


def run_with_kills(args: argparse.Namespace, out: Path) -> tuple[Lines, list[dict]]:
    """Run the quickstart, killing its engine `args.kills` times; (its output, each kill's time and step)."""
    rng = random.Random(args.seed)
    settings = [f"run.output_dir={out}", f"model.path={out / 'model'}", f"run.steps={args.steps}",
                "run.progress=false", "run.checkpoint_at_end=false", "eval=null", f"loop.mode={args.loop}",
                f"cluster.recovery.max_restarts={args.kills}", *args.overrides]
    cmd = [sys.executable, "-m", "distrl.cli", "train", "--config", "configs/quickstart.yaml",
           *(arg for s in settings for arg in ("--set", s))]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = Lines(proc)
    kills: list[dict] = []
    try:
        for _ in range(args.kills):
            target = lines.rows() + rng.randint(1, 4)
            while lines.rows() < target and proc.poll() is None:
                time.sleep(0.05)
            if proc.poll() is not None or target >= args.steps:
                break
            time.sleep(rng.uniform(0.0, 0.5))  # somewhere inside the next step (a step takes ~0.5-0.8 s)
            running = engines(proc.pid)
            if not running:
                break
            victim = rng.choice(running)
            at, step = time.monotonic(), lines.rows() + 1
            victim.kill()
            while lines.first("serves policy version", at) is None and proc.poll() is None:
                time.sleep(0.05)
            kills.append({"at": at, "step": step})
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)  # the reader's last lines
    if proc.returncode != 0:
        print("\n".join(line for _, line in lines.lines[-40:]))
        raise SystemExit(f"distrl train exited with {proc.returncode}")
    return lines, kills


def report(args: argparse.Namespace, rows: list[dict], lines: Lines, kills: list[dict]) -> None:
    by_step = {r["step"]: r for r in rows}
    healthy = [r["time/step"] for r in rows if r["step"] > 1 and not r["faults/rollout_restarts"]]
    median = statistics.median(healthy)
    print(f"\n{args.loop} loop, {args.steps} steps, {len(kills)} kills; median healthy step {median:.2f} s")
    print(f"{'kill':>4}{'in step':>9}{'detect s':>10}{'serving s':>11}{'step s':>8}{'extra steps':>13}")
    for i, kill in enumerate(kills, 1):
        detect = lines.first("died (ActorDiedError)", kill["at"])
        serving = lines.first("serves policy version", kill["at"])
        # The kill may land just after the step's row was printed: its cost then shows in the next step.
        hit = max((s for s in (kill["step"], kill["step"] + 1) if s in by_step),
                  key=lambda s: by_step[s]["time/step"])
        step_s = by_step[hit]["time/step"]
        print(f"{i:>4}{hit:>9}{(detect or float('nan')) - kill['at']:>10.2f}"
              f"{(serving or float('nan')) - kill['at']:>11.2f}{step_s:>8.2f}{(step_s - median) / median:>13.1f}")
    steps = [r["step"] for r in rows]
    print(f"rows: {len(rows)} for {args.steps} planned steps, "
          f"{'each once' if steps == list(range(1, args.steps + 1)) else f'NOT each once: {steps}'}; "
          f"restarts counted: {sum(r['faults/rollout_restarts'] for r in rows):.0f}, prompts re-dispatched: "
          f"{sum(r['faults/redispatched_prompts'] for r in rows):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop", choices=["sync", "async"], default="sync")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    out = Path(tempfile.mkdtemp(prefix="bench_faults-"))
    lines, kills = run_with_kills(args, out)
    rows = [json.loads(line) for line in (out / "quickstart" / "metrics.jsonl").read_text().splitlines()]
    report(args, rows, lines, kills)


if __name__ == "__main__":
    main()
