"""A tiny model learns a reasoning-gym task with the task's own scorer: `word_sequence_reversal` with three words
(configs/reasoning-gym.yaml), warm-started on the generator's own answers mixed with the words unreversed, then
GRPO with `score_answer` as the reward; held-out accuracy (the same generator, a seed range of its own) before and
after.

    PYTHONPATH=. python -m examples.reasoning_gym.run [--set key=value ...]

1. rows from reasoning-gym's generator: the warm start's (the config's `data` kwargs, one row per example: seeds
   1-80000 by default), GRPO's (the config's `data`: seeds 1-2000) and the held-out set's (its `eval.sets[0]`:
   seeds 1000001-1000200); how many held-out questions the warm start saw (the same three words drawn again);
2. a random 2-layer Llama whose tokenizer is trained on the first 5000 warm-start rows (`warm_start.build_model`);
3. a supervised warm start, half of the questions answered with the generator's answer and half with the words in
   the order given (`warm_start.warm_start`);
4. held-out accuracy (exact and the scorer's, sampled at T = 1 and greedy: `evaluate`), GRPO (`distrl.driver.
   train`, which evaluates the held-out set on its own engines every `eval.every` steps), and the held-out
   accuracy of the trained policy. Everything is written under artifacts/reasoning-gym/ and the run directory.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from distrl import config
from distrl.standards import reasoning_gym
from examples.calculator.run import trained_model
from examples.reasoning_gym.evaluate import Accuracy, evaluate
from examples.reasoning_gym.warm_start import build_model, warm_start

CONFIG = Path("configs/reasoning-gym.yaml")
ARTIFACTS = Path("artifacts/reasoning-gym")
WARM_BATCH = 32
DEFAULT_WARM_START_STEPS = 2500
TOKENIZER_ROWS = 5000


def show(when: str, figures: dict[str, Accuracy]) -> str:
    return ", ".join(f"{when} {name}: exact {a.exact:.3f}, score {a.score:.3f}" for name, a in figures.items())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--warm-start-steps", type=int, default=DEFAULT_WARM_START_STEPS)
    parser.add_argument("--right-frac", type=float, default=0.5,
                        help="share of warm-start answers that are the generator's (the rest: the words unreversed)")
    args = parser.parse_args(argv)
    cfg = config.load(CONFIG, args.overrides)
    assert cfg.data.function is not None and cfg.eval is not None
    began = time.perf_counter()
    warm_rows = reasoning_gym.rows(**{**cfg.data.kwargs, "size": args.warm_start_steps * WARM_BATCH})
    held_out = reasoning_gym.rows(**cfg.eval.sets[0].kwargs)
    seen = {row["prompt"] for row in warm_rows}
    overlap = sum(row["prompt"] in seen for row in held_out)
    print(f"{len(warm_rows)} warm-start rows, {cfg.data.kwargs['size']} GRPO rows (the first), {len(held_out)} "
          f"held-out rows, {overlap} of them among the warm start's questions")

    warm = Path(cfg.model.path)
    t = time.perf_counter()
    build_model(warm, warm_rows[:TOKENIZER_ROWS], cfg.run.seed)
    losses = warm_start(warm, warm_rows, args.warm_start_steps, cfg.run.seed, right_frac=args.right_frac,
                        batch_size=WARM_BATCH)
    warm_s = time.perf_counter() - t
    tokens = cfg.rollout.sampling.max_new_tokens
    temperature = cfg.rollout.sampling.temperature
    before = evaluate(warm, held_out, tokens, temperature)
    print(f"warm start: {args.warm_start_steps} steps in {warm_s:.0f} s, loss {losses[0]:.2f} -> {losses[-1]:.2f}")
    print(show("held-out before GRPO,", before))

    from distrl.driver import train

    t = time.perf_counter()
    history = train(cfg)
    grpo_s = time.perf_counter() - t
    after = evaluate(trained_model(Path(cfg.run.output_dir) / cfg.run.name, warm), held_out, tokens, temperature)
    name = cfg.eval.sets[0].name
    print("step  reward  held-out (distrl's engines): exact  score")
    for step, h in enumerate(history, start=1):
        curve = (f"  {h[f'eval/{name}/pass@1']:5.3f}  {h[f'eval/{name}/accuracy']:5.3f}"
                 if f"eval/{name}/accuracy" in h else "")
        print(f"{step:4d}  {h['reward/mean']:6.3f}{curve}")
    print(show("held-out before GRPO,", before))
    print(show("held-out after GRPO, ", after))
    total_s = time.perf_counter() - began
    print(f"wall time: warm start {warm_s:.0f} s, GRPO {grpo_s:.0f} s ({len(history)} steps), total {total_s:.0f} s")
    summary = {"overlap": overlap, "warm_start_s": warm_s, "grpo_s": grpo_s, "total_s": total_s,
               "before": {k: vars(a) for k, a in before.items()}, "after": {k: vars(a) for k, a in after.items()},
               "reward": [h["reward/mean"] for h in history], "warm_start_loss": [losses[0], losses[-1]],
               "held_out_curve": {h["step"]: {"exact": h[f"eval/{name}/pass@1"], "score": h[f"eval/{name}/accuracy"]}
                                  for h in history if f"eval/{name}/accuracy" in h}}
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
