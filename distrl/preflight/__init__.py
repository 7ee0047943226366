"""Preflight: what a run needs that can be checked without Ray, checked before any cluster or actor starts.

- the model (`model.py`): a hub name resolves through the Hugging Face cache as every role will resolve it, its
  config loads, and its context length holds what the rollout engine needs (`rollout.max_model_len`, or
  `data.max_prompt_tokens + rollout.sampling.max_new_tokens`); the tokenizer loads; the reference model's config
  loads when a KL term needs one;
- what the run reads and calls (`inputs.py`): the data's source resolves (a hub name through the Hugging Face
  cache, honouring `HF_HUB_OFFLINE`), every row parses and holds a usable prompt, answer and reward columns
  (`data.check_rows`), and the tokenizer has a chat template if some prompt needs one, which renders the first of
  them; the held-out sets read as the data does and draw no training rows from a generator (reasoning-gym's
  seeds); the reward function imports; the environment resolves and takes
  its kwargs; every adapter to another standard that the config names (`distrl.standards`) has its package
  installed, else the line says which `pip install` brings it, and its environment has what it needs (a verifiers
  environment with tools, `env.tool_parser`);
- where it runs (`placement.py`): the run directory can be made and written, and `run.resume` / `run.overwrite`
  fit what is already there; on the embedded cluster, the roles' CPUs and GPUs fit this machine;
- `kernels: liger` can run (liger-kernel installed, the model's type one it patches:
  `distrl.workers.training.kernel_support`), else a role whose liger is the GPU default falls back to `plain`, with a
  note.

Each problem is one line that starts with the config field it concerns; `check` reports them all at once, so one
corrected re-run is enough. With `model.create_tiny_if_missing` a missing model is fine (it is built on first use,
with the tiny model's known context length).

Light at import time: transformers is imported only when there is a model to check.
"""

from __future__ import annotations

from distrl.config import Config
from distrl.preflight.inputs import (
    check_data,
    check_env,
    check_env_adapter,
    check_eval,
    check_held_out,
    check_reward,
    check_standards,
)
from distrl.preflight.model import check_model, context_length, model_dir
from distrl.preflight.placement import check_resources, check_run_dir
from distrl.workers.training.kernel_support import check_liger

__all__ = ["PreflightError", "check", "context_length"]


class PreflightError(ValueError):
    """The config is valid but the run cannot start; `problems` holds one line per problem, each naming its field."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        head = f"cannot start the run: {len(problems)} problem{'s' if len(problems) > 1 else ''}"
        super().__init__("\n".join([head, *(f"  {p}" for p in problems)]))


def check(cfg: Config, training: bool = True) -> None:
    """Raise PreflightError listing every problem found; return quietly when there is none. Without `training`
    (`distrl eval`), what only a training run needs (its data, run directory and cluster) is left out."""
    problems: list[str] = []
    tokenizer = check_model(cfg, problems)
    absent = check_standards(cfg, problems)
    if training and "data" not in absent:
        check_data(cfg.data, tokenizer, problems)
    if cfg.env is None:
        check_reward(cfg.reward, problems)
    else:
        check_env(cfg.env, problems)
        if "env" not in absent:
            check_env_adapter(cfg.env, problems)
    if "eval" not in absent:
        check_eval(cfg, problems)
        check_held_out(cfg, problems)
    if training:
        check_run_dir(cfg.run, problems)
        check_resources(cfg, problems)
        problems += check_liger(cfg, lambda path: model_dir(path, "", "config.json", []))  # unresolved: check_model's
    if problems:
        raise PreflightError(problems)
