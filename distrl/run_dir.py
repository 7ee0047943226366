"""The run directory and what the user sees: resolved config, metrics sinks, progress bar, end-of-run summary.

RUN_DIR = run.output_dir/run.name holds config.yaml (the resolved config), metrics.jsonl, tensorboard/, checkpoints/,
samples/ (training samples to read, `run.samples_every`), eval/ (every evaluated sample, `eval`), and with
`run.trackers` trackers.json (the trackers' run ids) and wandb/ (W&B's files). Those are the only paths
distrl writes or deletes there: other files in RUN_DIR are the user's. A run that ends before logging its first step
takes back what it created, so no directory is left holding no run.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from distrl import checkpoint
from distrl.agents.figures import episode_metrics
from distrl.config import Config, RunConfig, to_yaml
from distrl.metrics import JsonlSink, MetricsLogger, RayMetricsSink, Sink, TensorBoardSink
from distrl.stop import Stopped
from distrl.trackers import IDS, Trackers
from distrl.trackers.base import EndState

if TYPE_CHECKING:
    from distrl.cluster.weight_sync import SyncStats
    from distrl.data.prompts import DataStats
    from distrl.types.rollouts import ScoredRollouts

# Learner/loss metric names (distrl.algo) -> the names users read in metrics.jsonl and dashboards.
RENAMES = {
    "clip_frac": "clip/frac", "dual_clip_frac": "clip/dual_frac", "ppo_kl": "kl/ppo", "kl_ref": "kl/ref",
    "entropy": "policy/entropy", "mismatch_kl": "correction/mismatch_kl", "mismatch_k3": "correction/mismatch_k3",
    "is_weight_mean": "correction/weight_mean", "is_weight_min": "correction/weight_min",
    "is_weight_max": "correction/weight_max", "is_frac_truncated": "correction/frac_truncated",
    "is_frac_masked": "correction/frac_masked", "is_ess": "correction/ess",
    # the other policy losses' own figures (distrl/algo/policy_terms.py)
    "cov_frac": "policy/cov_frac", "gate_mean": "policy/gate_mean", "gated_frac": "policy/gated_frac",
    "seq_ratio_mean": "policy/seq_ratio_mean", "seq_ratio_min": "policy/seq_ratio_min",
    "seq_ratio_max": "policy/seq_ratio_max",
}
# Phases that are the driver's own work rather than a wait for actors or tasks: part of time/driver_overhead.
DRIVER_PHASES = ("time/advantages",)
ALWAYS = ("loss/policy", "kl/ref", "correction/mismatch_kl", "correction/weight_mean", "clip/frac")
SPARK = "▁▂▃▄▅▆▇█"
OWN = ("config.yaml", "metrics.jsonl", "tensorboard", "checkpoints", IDS, "wandb", "eval", "samples")
"""What distrl writes in a run directory, and all that `run.overwrite` deletes."""


def _remove(path: Path) -> None:
    """Delete `path`: a directory with its contents, a file or a symbolic link (the link only, never its target)."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def holds_run(path: Path) -> bool:
    """Whether run directory `path` holds a run: a logged step (a row in metrics.jsonl) or a checkpoint."""
    metrics, checkpoints = path / "metrics.jsonl", path / "checkpoints"
    return bool((metrics.is_file() and metrics.stat().st_size) or (checkpoints.is_dir() and any(checkpoints.iterdir())))


def reuse_problem(path: Path, run: RunConfig) -> str | None:
    """Why a run with settings `run` may not start in run directory `path` (a line that starts with the field to
    change), or None: one that already holds a run needs `run.resume` or `run.overwrite`, and `run.resume` alone
    needs a usable checkpoint there (files and sizes checked; the driver reads the checksums), since starting at
    step 1 would mix two runs' files."""
    if not holds_run(path):
        return None
    if not (run.resume or run.overwrite):
        return (f"run.name: {path} already holds a run: set run.resume=true to continue it, run.overwrite=true to "
                f"replace it, or choose another run.name")
    if run.resume and not run.overwrite:
        found, refused = checkpoint.newest_usable(path, checksums=False)
        if found is None:
            if refused:
                why = f"; the newest: {refused[0]}"
            elif any((path / "checkpoints").glob(f"{checkpoint.PREFIX}*.damaged*")):
                why = "; only checkpoints set aside as damaged"
            else:
                why = " (set run.checkpoint_every to keep some)"
            return (f"run.resume: {path} holds a run but no usable checkpoint to continue it from{why}. Set "
                    f"run.overwrite=true (and run.resume=false) to start it afresh")
    return None


class RunDir:
    """RUN_DIR of one run: claimed when made, written as steps are logged; `close()` removes what it created if no
    step was logged (a run that failed to start). As a context manager, it closes with the run's end state."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Absolute: the paths handed to actors (checkpoints) must not depend on their working directories.
        self.path = Path(cfg.run.output_dir).absolute() / cfg.run.name
        self._made_dirs, self._made = self._claim()
        self.bar = None
        try:
            (self.path / "config.yaml").write_text(to_yaml(cfg))
            sinks: list[Sink] = [JsonlSink(self.path / "metrics.jsonl")]
            if cfg.run.tensorboard:
                sinks.append(TensorBoardSink(self.path / "tensorboard"))
            if cfg.run.ray_metrics:
                sinks.append(RayMetricsSink(cfg.run.name))
        except BaseException:
            self._discard_if_empty()
            raise
        self.logger = MetricsLogger(sinks)
        self.trackers = Trackers()
        self.last_step = 0  # the last step logged by this process
        self._start = self._step_start = time.perf_counter()

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(err, (Stopped, KeyboardInterrupt)):  # a signal during start-up, or a second one (StopNow)
            state: EndState = "stopped"
        elif err is not None:
            state = "failed"
        else:  # left without an error before the last step only when a signal stopped it after a step
            state = "finished" if self.last_step >= self.cfg.run.steps else "stopped"
        self.close(state)

    def start_trackers(self, resumed: bool) -> None:
        """Start the trackers of `run.trackers` (W&B, MLflow) with the resolved config; `resumed`: continue the
        tracker runs this directory's earlier run had (trackers.json)."""
        self.trackers.start(self.cfg, self.path, resumed)

    def _claim(self) -> tuple[list[Path], list[Path]]:
        """Create the run directory (deleting a previous run's files with `run.overwrite`). Returns the directories
        this created, deepest first, and the entries of OWN it is about to create."""
        problem = reuse_problem(self.path, self.cfg.run)
        if problem:
            raise FileExistsError(problem)
        # With run.resume too, a directory that holds a usable checkpoint is continued, not replaced (RunConfig).
        resuming = self.cfg.run.resume and checkpoint.newest_usable(self.path, checksums=False)[0] is not None
        if self.cfg.run.overwrite and holds_run(self.path) and not resuming:
            for name in OWN:
                _remove(self.path / name)
        made_dirs = [p for p in (self.path, *self.path.parents) if not p.exists()]
        self.path.mkdir(parents=True, exist_ok=True)
        made = [self.path / name for name in OWN if not (self.path / name).exists()]
        return made_dirs, made

    def _discard_if_empty(self) -> None:
        """Remove what this RunDir created, if the run directory holds no run: the directory itself only if it was
        made here and nothing else has appeared in it."""
        if holds_run(self.path):
            return
        for path in self._made:
            _remove(path)
        for directory in self._made_dirs:
            if directory.is_dir():
                if any(directory.iterdir()):
                    break
                directory.rmdir()

    def forget_after(self, step: int) -> list[dict[str, Any]]:
        """Drop metrics rows after `step` (a resumed run logs those steps again); returns the rows kept."""
        path = self.path / "metrics.jsonl"
        kept = [(line, row) for line in path.read_text().splitlines() if (row := json.loads(line))["step"] <= step]
        path.write_text("".join(line + "\n" for line, _ in kept))
        return [row for _, row in kept]

    def progress(self, steps: Iterable[int]) -> Iterator[int]:
        """Iterate steps behind a progress bar (step, reward, tokens/s, ETA) when `run.progress` is set."""
        if self.cfg.run.progress:
            from tqdm import tqdm

            steps = self.bar = tqdm(steps, desc="train", unit="step", dynamic_ncols=True)
        # A step runs from the end of the previous step's metrics to the end of its own, so the time spent
        # logging step k is counted (as driver overhead) in step k+1, and the steps' times add up to the run's.
        self._step_start = time.perf_counter()
        yield from steps

    def step_metrics(self, step: int, scored: ScoredRollouts, metrics: dict[str, float], sync: SyncStats | None,
                     times: dict[str, float], data_stats: DataStats) -> dict[str, float | None]:
        """The row of `step`: the batch's rewards and lengths, `metrics` (advantages, update, staleness,
        producer; loss names mapped by RENAMES), phase times, throughput and the weight push (None when the push
        is confirmed later, in the asynchronous loop)."""
        rollouts = scored.rollouts
        episodes = scored.episode_rewards()
        lengths = [len(r) for r in rollouts.response_ids]
        tokens = sum(lengths)
        step_time = time.perf_counter() - self._step_start
        m: dict[str, float | None] = dict.fromkeys(ALWAYS)
        m.update({
            "policy_version": float(max(rollouts.policy_version)),  # the newest weights that sampled this batch
            # Per episode: an episode of several sequences holds its reward on each of them.
            "reward/mean": statistics.fmean(episodes), "reward/std": statistics.pstdev(episodes),
            "response_length/mean": statistics.fmean(lengths), "response_length/max": float(max(lengths)),
            "response_length/truncated_frac": statistics.fmean(f == "length" for f in rollouts.finish_reasons),
            "data/dropped_prompts": float(data_stats.dropped),
        })
        if self.cfg.env is not None:
            m.update(episode_metrics(rollouts))
        m.update({RENAMES.get(k, k): v for k, v in metrics.items()})
        m.update(times)
        generate = times.get("time/generate", 0.0)
        m.update({
            "time/step": step_time,
            "time/driver_overhead": max(0.0, step_time - sum(v for k, v in times.items() if k not in DRIVER_PHASES)),
            "time/elapsed": time.perf_counter() - self._start,
            "throughput/tokens_per_s": tokens / step_time,
            "rollout/tokens_per_s": tokens / generate if generate > 0 else None,
            # The engine seconds of this batch's samples against the rollout actors' time over the step.
            "rollout/engine_busy_frac": sum(e.engine_s for e in rollouts.episodes)
                                        / (step_time * self.cfg.engines),
            "sync/bytes": float(sync.bytes) if sync else None,
            "sync/bytes_per_s": sync.bytes_per_s if sync else None,
        })
        self._step_start = time.perf_counter()
        return m

    def log(self, step: int, metrics: dict[str, float | None]) -> None:
        self.logger.log(step, metrics)
        self.trackers.log(step, metrics)
        self.last_step = step
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}",
                                 tok_s=f"{metrics['throughput/tokens_per_s']:.0f}")
        elif step % self.cfg.run.log_every == 0:
            print(f"step {step}: reward {metrics['reward/mean']:.3f}, loss {metrics['loss/policy']}, "
                  f"{metrics['throughput/tokens_per_s']:.0f} tok/s, {metrics['time/step']:.1f}s")

    def write_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Training samples of `step` for a person to read ({prompt, completion, reward, advantage, ...}): to
        RUN_DIR/samples/step_<N>.jsonl and TensorBoard's text tab."""
        directory = self.path / "samples"
        directory.mkdir(exist_ok=True)
        (directory / f"step_{step:06d}.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
        shown = "\n\n".join(f"**reward {s['reward']:.3f}, advantage {s['advantage']:+.3f}**\n\n"
                              f"```\n{s['prompt']}\n--- completion ---\n{s['completion']}\n```" for s in samples)
        self.logger.text(step, "samples", shown)

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
        shown = Path(self.cfg.run.output_dir) / self.cfg.run.name  # as the user wrote it
        for key in sorted({k for h in history for k in h if k.startswith("eval/") and k.endswith("/accuracy")}):
            held = [(h["step"], h[key]) for h in history if h.get(key) is not None]
            name = key.removeprefix("eval/").removesuffix("/accuracy")
            print(f"held-out {name}: accuracy " + " -> ".join(f"{v:.3f} (step {s})" for s, v in held)
                  + f"; samples in {shown / 'eval' / name}")
        print(f"metrics: {shown / 'metrics.jsonl'}")
        if self.cfg.run.tensorboard:
            print(f"tensorboard: tensorboard --logdir {shown / 'tensorboard'}")

    def close(self, state: EndState = "finished") -> None:
        """Close the files and the trackers' runs, marking them `state`."""
        if self.bar is not None:
            self.bar.close()
        self.logger.close()
        self.trackers.finish(state)
        self._discard_if_empty()
