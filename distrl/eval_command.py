"""`distrl eval`: evaluate a checkpoint (or any model) on the config's held-out sets without training.

One vLLM engine in this process (the GPU when there is one), the sets' prompts sampled with `eval.sampling` and
scored by their reward functions (or the environment) here, with the same figures as during training. Every
sample (prompt, completion, reward, extracted answer, the reward's info) goes to `<output>/<set>.jsonl` and the
figures to `<output>/figures.json`.
"""

from __future__ import annotations

import functools
import gc
import json
import os
from pathlib import Path

from distrl import checkpoint
from distrl.config import Config
from distrl.evaluation import write_samples
from distrl.evaluator import Evaluator


class EvalError(ValueError):
    """What to evaluate cannot be found or the config has no held-out sets."""


def model_to_evaluate(cfg: Config, checkpoint_dir: str | None, model: str | None) -> tuple[Config, int]:
    """The config whose `model.path` is what to evaluate (a checkpoint's policy, another model, or the config's own)
    and the policy version it holds (the checkpoint's step; 0 otherwise). The tokenizer stays the config's."""
    if checkpoint_dir is not None and model is not None:
        raise EvalError("give --checkpoint or --model, not both")
    step, path = 0, model
    if checkpoint_dir is not None:
        policy = Path(checkpoint_dir) / "policy" / "model"
        if (policy.parent / "adapter").is_dir():
            raise EvalError(f"--checkpoint {checkpoint_dir} holds LoRA adapters (policy/adapter): merge them into the "
                            f"base with `distrl export --config CONFIG --checkpoint {checkpoint_dir} --merge --output "
                            f"DIR`, then evaluate --model DIR")
        if not (policy / "config.json").is_file():
            raise EvalError(f"--checkpoint {checkpoint_dir}: no policy model at {policy} (a checkpoint directory is "
                            f"RUN_DIR/checkpoints/step_N)")
        step, path = int(checkpoint.driver_state(Path(checkpoint_dir))["step"]), str(policy)
    if path is None:
        return cfg, 0
    tokenizer = cfg.model.tokenizer or cfg.model.path
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": path, "tokenizer": tokenizer,
                                                                        "create_tiny_if_missing": False})}), step


def evaluate(cfg: Config, version: int, output: Path) -> dict[str, float]:
    """Evaluate `cfg.model` on `cfg.eval`'s sets; write the samples and figures under `output`; return the
    figures."""
    # vLLM logs to stdout by default: to stderr here, so that the figures printed on stdout can be piped.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import torch

    from distrl.cluster.roles import sampling_seed
    from distrl.workers.model_files import load_tokenizer
    from distrl.workers.rewards import score_batch
    from distrl.workers.rollout.worker import RolloutWorker

    if cfg.eval is None:
        raise EvalError("the config has no eval section: name the held-out sets in eval.sets")
    evaluator = Evaluator(cfg, load_tokenizer(cfg.model))
    longest = max(max((len(p.prompt_ids) for p in prompts), default=1) for _, prompts in evaluator.sets)
    worker = RolloutWorker(cfg.rollout, cfg.model, max_prompt_tokens=longest, seed=sampling_seed(cfg),
                           num_gpus=1.0 if torch.cuda.is_available() else 0.0, environment=cfg.env,
                           max_new_tokens=cfg.longest_turn_tokens)
    worker.served.version = version
    sampling, on_error = cfg.eval.sampling, cfg.reward.on_error
    try:
        figures, samples = evaluator.run(functools.partial(worker.generate, sampling=sampling),
                                         functools.partial(score_batch, on_error=on_error))
    finally:
        worker.close()
        # vLLM tears down process-wide state (its parallel groups) when its engine is collected: now, not under a
        # later engine of this process.
        del worker
        gc.collect()
    for name, part in samples.items():
        write_samples(output / f"{name}.jsonl", part)
    (output / "figures.json").write_text(json.dumps({"policy_version": version, **figures}, indent=1) + "\n")
    return figures
