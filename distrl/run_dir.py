"""The run directory and what the user sees: resolved config, metrics sinks, progress bar, end-of-run summary.

RUN_DIR = run.output_dir/run.name holds config.yaml (the resolved config), metrics.jsonl, tensorboard/ and
checkpoints/.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from distrl.config import Config, to_yaml
from distrl.metrics import JsonlSink, MetricsLogger, RayMetricsSink, Sink, TensorBoardSink

# Learner/loss metric names (distrl.algo) -> the names users read in metrics.jsonl and dashboards.
RENAMES = {
    "clip_frac": "clip/frac", "dual_clip_frac": "clip/dual_frac", "ppo_kl": "kl/ppo", "kl_ref": "kl/ref",
    "entropy": "policy/entropy", "mismatch_kl": "correction/mismatch_kl", "mismatch_k3": "correction/mismatch_k3",
    "is_weight_mean": "correction/weight_mean", "is_weight_min": "correction/weight_min",
    "is_weight_max": "correction/weight_max", "is_frac_truncated": "correction/frac_truncated",
    "is_frac_masked": "correction/frac_masked", "is_ess": "correction/ess",
}
# Phases that are the driver's own work rather than a wait for actors or tasks: part of time/driver_overhead.
DRIVER_PHASES = ("time/advantages",)
ALWAYS = ("loss/policy", "kl/ref", "correction/mismatch_kl", "correction/weight_mean", "clip/frac")
SPARK = "▁▂▃▄▅▆▇█"


class RunDir:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.path = Path(cfg.run.output_dir) / cfg.run.name
        self._claim()
        (self.path / "config.yaml").write_text(to_yaml(cfg))
        sinks: list[Sink] = [JsonlSink(self.path / "metrics.jsonl")]
        if cfg.run.tensorboard:
            sinks.append(TensorBoardSink(self.path / "tensorboard"))
        if cfg.run.ray_metrics:
            sinks.append(RayMetricsSink(cfg.run.name))
        self.logger = MetricsLogger(sinks)
        self.bar = None
        self._start = self._step_start = time.perf_counter()

    def _claim(self) -> None:
        """Create the run directory; one that already holds a run needs `run.resume` or `run.overwrite`."""
        used = (self.path / "metrics.jsonl").exists() or (self.path / "checkpoints").exists()
        if used and self.cfg.run.overwrite:
            shutil.rmtree(self.path)
        elif used and not self.cfg.run.resume:
            raise FileExistsError(f"{self.path} already holds a run: set run.resume=true to continue it, "
                                  f"run.overwrite=true to replace it, or choose another run.name")
        self.path.mkdir(parents=True, exist_ok=True)

    def forget_after(self, step: int) -> None:
        """Drop metrics rows after `step` (a resumed run logs those steps again)."""
        path = self.path / "metrics.jsonl"
        rows = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= step]
        path.write_text("".join(row + "\n" for row in rows))

    def progress(self, steps: Iterable[int]) -> Iterator[int]:
        """Iterate steps behind a progress bar (step, reward, tokens/s, ETA) when `run.progress` is set."""
        if self.cfg.run.progress:
            from tqdm import tqdm

            steps = self.bar = tqdm(steps, desc="train", unit="step", dynamic_ncols=True)
        # A step runs from the end of the previous step's metrics to the end of its own, so the time spent
        # logging step k is counted (as driver overhead) in step k+1, and the steps' times add up to the run's.
        self._step_start = time.perf_counter()
        yield from steps

    def step_metrics(self, step, rollouts, rewards, reward_errors, adv_metrics, update_metrics, sync, times,
                     data_stats) -> dict[str, float | None]:
        lengths = [len(r) for r in rollouts.response_ids]
        tokens = sum(lengths)
        step_time = time.perf_counter() - self._step_start
        m: dict[str, float | None] = dict.fromkeys(ALWAYS)
        m.update({
            "policy_version": float(rollouts.policy_version),  # the weights that sampled this step
            "reward/mean": statistics.fmean(rewards), "reward/std": statistics.pstdev(rewards),
            "reward/errors": float(reward_errors),
            "response_length/mean": statistics.fmean(lengths), "response_length/max": float(max(lengths)),
            "response_length/truncated_frac": statistics.fmean(f == "length" for f in rollouts.finish_reasons),
            "data/dropped_prompts": float(data_stats.dropped),
        })
        m.update(adv_metrics)
        m.update({RENAMES.get(k, k): v for k, v in update_metrics.items()})
        m.update(times)
        m.update({
            "time/step": step_time,
            "time/driver_overhead": max(0.0, step_time - sum(v for k, v in times.items() if k not in DRIVER_PHASES)),
            "time/elapsed": time.perf_counter() - self._start,
            "throughput/tokens_per_s": tokens / step_time,
            "rollout/tokens_per_s": tokens / times["time/generate"],
            "sync/bytes": float(sync.bytes), "sync/bytes_per_s": sync.bytes_per_s,
        })
        self._step_start = time.perf_counter()
        return m

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        self.logger.log(step, metrics)
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                                 tok_s=f"{metrics['throughput/tokens_per_s']:.0f}")
        elif step % self.cfg.run.log_every == 0:
            print(f"step {step}: reward {metrics['reward/mean']:.3f}, loss {metrics['loss/policy']}, "
                  f"{metrics['throughput/tokens_per_s']:.0f} tok/s, {metrics['time/step']:.1f}s")

    def checkpoint_due(self, step: int) -> bool:
        every, last = self.cfg.run.checkpoint_every, step == self.cfg.run.steps
        return bool((every and step % every == 0) or (last and self.cfg.run.checkpoint_at_end))

    def summary(self, history: list[dict]) -> None:
        """Print the reward curve (first vs last steps) and where the metrics are."""
        if not history:
            return
        rewards = [h["reward/mean"] for h in history]
        k = max(1, len(rewards) // 5)
        lo, hi = min(rewards), max(rewards)
        spark = "".join(SPARK[int((r - lo) / (hi - lo + 1e-12) * (len(SPARK) - 1))] for r in rewards)
        print(f"\nreward per step: {spark}  (min {lo:.3f}, max {hi:.3f})")
        print(f"mean reward, first {k} step(s): {statistics.fmean(rewards[:k]):.3f}  ->  "
              f"last {k} step(s): {statistics.fmean(rewards[-k:]):.3f}")
        print(f"metrics: {self.path / 'metrics.jsonl'}")
        if self.cfg.run.tensorboard:
            print(f"tensorboard: tensorboard --logdir {self.path / 'tensorboard'}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.logger.close()
