"""The calculator example from start to end: problems, warm start, held-out evaluation, GRPO over two-turn
episodes with `configs/agent-calculator.yaml`, held-out evaluation of the trained policy, and the curve.

    PYTHONPATH=. python -m examples.calculator.run [--set key=value ...]

`--set` overrides the training config as `distrl train --set` does (e.g. `--set run.steps=40`). Everything is
written under `artifacts/calculator/` and the run directory (`runs/calculator/`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

from distrl import checkpoint, config
from examples.calculator.evaluate import Evaluation, evaluate
from examples.calculator.problems import make_splits, write_jsonl
from examples.calculator.warm_start import build_model, warm_start

CONFIG = Path("configs/agent-calculator.yaml")
ARTIFACTS = Path("artifacts/calculator")
TEMPERATURES = {"sampled": 1.0, "greedy": 0.0}
"""Held-out evaluations: sampled at the training temperature (how often the policy calls the tool), and greedy."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def trained_model(run_dir: Path, warm: Path) -> Path:
    """The newest checkpoint's policy as an HF directory, with the warm-started model's tokenizer (checkpoints
    hold the weights only)."""
    latest = checkpoint.latest(run_dir)
    if latest is None:
        raise FileNotFoundError(f"no checkpoint under {run_dir}/checkpoints: the run saves one at its end "
                                f"(run.checkpoint_at_end)")
    model = latest / "policy" / "model"
    for name in TOKENIZER_FILES:
        if (warm / name).exists():
            shutil.copy(warm / name, model / name)
    return model


def show(name: str, e: Evaluation) -> str:
    return (f"{name}: reward {e.reward:.2f}, tool use (right calculator call) {e.tool_use:.2f}, "
            f"called the tool {e.called:.2f} (n = {e.n})")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--warm-start-steps", type=int, default=800)
    parser.add_argument("--tool-frac", type=float, default=0.5,
                        help="share of warm-start examples that call the calculator (the rest guess)")
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-eval", type=int, default=200)
    args = parser.parse_args(argv)
    cfg = config.load(CONFIG, args.overrides)
    began = time.perf_counter()

    train_rows, held_out = make_splits(args.n_train, args.n_eval, cfg.run.seed)
    write_jsonl(train_rows, cfg.data.path)
    write_jsonl(held_out, ARTIFACTS / "heldout.jsonl")
    warm = Path(cfg.model.path)
    t = time.perf_counter()
    base = build_model(ARTIFACTS / "base", train_rows[:100], seed=cfg.run.seed)
    losses = warm_start(base, warm, train_rows, steps=args.warm_start_steps, tool_frac=args.tool_frac,
                        seed=cfg.run.seed)
    warm_s = time.perf_counter() - t
    before = {name: evaluate(cfg, warm, held_out, temperature=temp) for name, temp in TEMPERATURES.items()}
    print(f"warm start: {args.warm_start_steps} steps in {warm_s:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    for name, e in before.items():
        print(show(f"held-out before GRPO, {name}", e))

    from distrl.driver import train

    t = time.perf_counter()
    history = train(cfg)
    grpo_s = time.perf_counter() - t
    trained = trained_model(Path(cfg.run.output_dir) / cfg.run.name, warm)
    after = {name: evaluate(cfg, trained, held_out, temperature=temp) for name, temp in TEMPERATURES.items()}
    episodes = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    print("step  reward  tool calls/episode  turns")
    for step, h in enumerate(history, start=1):
        print(f"{step:4d}  {h['reward/mean']:6.3f}  {h['agent/tool_calls'] / episodes:18.2f}  "
              f"{h['agent/turns_mean']:5.2f}")
    for name in TEMPERATURES:
        print(show(f"held-out before GRPO, {name}", before[name]))
        print(show(f"held-out after GRPO,  {name}", after[name]))
    total_s = time.perf_counter() - began
    print(f"wall time: warm start {warm_s:.0f} s, GRPO {grpo_s:.0f} s ({len(history)} steps), total {total_s:.0f} s")
    summary = {"warm_start_s": warm_s, "grpo_s": grpo_s, "total_s": total_s,
               "before": {k: vars(e) for k, e in before.items()}, "after": {k: vars(e) for k, e in after.items()},
               "reward": [h["reward/mean"] for h in history],
               "tool_calls_per_episode": [h["agent/tool_calls"] / episodes for h in history]}
    (ARTIFACTS / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
