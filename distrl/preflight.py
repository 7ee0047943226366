"""Preflight: what a run needs that can be checked without Ray, checked before any cluster or actor starts.

- the model: a hub name resolves through the Hugging Face cache as every role will resolve it, its config loads,
  and its context length holds what the rollout engine needs (`rollout.max_model_len`, or `data.max_prompt_tokens +
  rollout.sampling.max_new_tokens`); the tokenizer loads; the reference model's config loads when a KL term needs
  one;
- the data: its source resolves (a hub name through the Hugging Face cache, honouring `HF_HUB_OFFLINE`), every row
  parses and holds a usable prompt, answer and reward columns (`data.check_rows`), and the tokenizer has a chat
  template if some prompt needs one, which renders the first of them;
- the reward function imports; every adapter to another standard that the config names (`distrl.standards`) has
  its package installed, else the line says which `pip install` brings it;
- the run directory can be made and written, and `run.resume` / `run.overwrite` fit what is already there;
- on the embedded cluster, the roles' CPUs and GPUs fit this machine;
- `kernels: liger` can run (liger-kernel installed, the model's type one it patches: `distrl.workers.kernel_support`),
  else a role whose liger is the GPU default falls back to `plain`, with a note.

Each problem is one line that starts with the config field it concerns; `check` reports them all at once, so one
corrected re-run is enough. With `model.create_tiny_if_missing` a missing model is fine (it is built on first use,
with the tiny model's known context length).

Light at import time: transformers is imported only when there is a model to check.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from distrl.config import Config, DataConfig, EnvConfig, RewardConfig, RunConfig
from distrl.data.prompts import check_rows
from distrl.data.sources import DataError
from distrl.hub import HubError, is_hub_name, local_dir
from distrl.run_dir import reuse_problem
from distrl.workers.kernel_support import check_liger

__all__ = ["PreflightError", "check", "context_length"]

# Config keys that state a model's context length, as vLLM reads them (the smallest wins; model_max_length, when
# the model config has it, overrides the rest).
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings already includes their scaling: vLLM does not multiply by `factor`.
PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


# Set by Ray's job supervisor in the environment of a job's entrypoint (`ray job submit -- distrl train ...`).
RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


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
    tokenizer = _model(cfg, problems)
    absent = _standards(cfg, problems)
    if training and "data" not in absent:
        _data(cfg.data, tokenizer, problems)
    if cfg.env is None:
        _reward(cfg.reward, problems)
    else:
        _env(cfg.env, problems)
    if "eval" not in absent:
        _eval(cfg, problems)
    if training:
        _run_dir(cfg.run, problems)
        _resources(cfg, problems)
        problems += check_liger(cfg, lambda path: _model_dir(path, "", "config.json", []))  # unresolved: _model's
    if problems:
        raise PreflightError(problems)


# --------------------------------------------------------------------------------------------------------- model
def _model(cfg: Config, problems: list[str]):
    """Check the policy (config, context length, tokenizer) and the reference; returns the tokenizer if it loads."""
    m = cfg.model
    tokenizer = None
    if m.create_tiny_if_missing and not (Path(m.path) / "config.json").is_file():
        from distrl.workers.tiny_model import CONTEXT_LENGTH

        _context(cfg, CONTEXT_LENGTH, "max_position_embeddings of the tiny model", problems)
        if m.tokenizer:
            tokenizer = _tokenizer(m.tokenizer, "model.tokenizer", m.trust_remote_code, problems)
    else:
        hf_config = _hf_config(m.path, "model.path", m.trust_remote_code, problems)
        if hf_config is not None or m.tokenizer:  # a missing model is one problem, not two
            tokenizer = _tokenizer(m.tokenizer or m.path, "model.tokenizer" if m.tokenizer else "model.path",
                                   m.trust_remote_code, problems)
        if hf_config is not None:
            limit, key = context_length(hf_config, tokenizer)
            if limit is not None:
                _context(cfg, limit, key, problems)
    if cfg.needs_reference and cfg.reference.path:
        _hf_config(cfg.reference.path, "reference.path", m.trust_remote_code, problems)
    if cfg.critic is not None and cfg.critic.path:
        _hf_config(cfg.critic.path, "critic.path", m.trust_remote_code, problems)
    return tokenizer


def _hf_config(path: str, field: str, trust_remote_code: bool, problems: list[str]):
    """The model's transformers config, or None after noting why it cannot be loaded."""
    local = _model_dir(path, field, "config.json", problems)
    if local is None:
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(local, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        hub = "" if local == path else f" (the hub name's snapshot in the Hugging Face cache, {local})"
        problems.append(f"{field}: cannot load the model config from {path}{hub}: {_one_line(err)}")
        return None


def _tokenizer(path: str, field: str, trust_remote_code: bool, problems: list[str]):
    local = _model_dir(path, field, None, problems)
    if local is None:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:
        problems.append(f"{field}: cannot load a tokenizer from {path}: {_one_line(err)}")
        return None


def _model_dir(path: str, field: str, needs: str | None, problems: list[str]) -> str | None:
    """The local directory of model path `path` (holding `needs`), as every role resolves it (`distrl.hub`: a hub
    name through the Hugging Face cache; here its config and tokenizer files only), or None after noting why not."""
    local = Path(path).expanduser()
    if local.exists() and not local.is_dir():
        problems.append(f"{field}: {path} is a file, not a model directory")
        return None
    if not local.exists() and not is_hub_name(path):
        problems.append(f"{field}: {path} does not exist{_relative_note(path)}")
        return None
    try:
        resolved = local_dir(path, weights=False)
    except HubError as err:
        problems.append(f"{field}: {err}")
        return None
    if needs is not None and not (Path(resolved) / needs).is_file():
        problems.append(f"{field}: {path} holds no {needs}")
        return None
    return resolved


def context_length(hf_config, tokenizer=None) -> tuple[float | None, str]:
    """The longest sequence vLLM serves for a model, and where that figure comes from; (None, '') when the config
    states none (vLLM then assumes 2048 and accepts a longer rollout.max_model_len).

    vLLM's rule: the smallest of the config's context keys (`model_max_length` overrides them), times the RoPE
    scaling factor unless the RoPE type already includes it, and at most the tokenizer's `model_max_length`.
    """
    text = hf_config.get_text_config()
    found = {k: getattr(text, k) for k in CONTEXT_KEYS if isinstance(getattr(text, k, None), (int, float))}
    if not found:
        return None, ""
    key = "model_max_length" if "model_max_length" in found else min(found, key=found.__getitem__)
    limit, source = float(found[key]), f"{key} in the model config"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if isinstance(rope, dict) and "gemma3" not in str(getattr(hf_config, "model_type", "")):
        layers = [rope] if "rope_type" in rope or "type" in rope else [v for v in rope.values() if isinstance(v, dict)]
        factor = 1.0
        for params in layers:
            if params.get("rope_type", params.get("type")) not in PRESCALED_ROPE:
                factor = params.get("factor") or factor
        limit *= factor
    tokenizer_limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(tokenizer_limit, int) and tokenizer_limit < limit:
        limit, source = float(tokenizer_limit), "model_max_length of the tokenizer"
    return limit, source


def _context(cfg: Config, limit: float, source: str, problems: list[str]) -> None:
    """Note a problem if the engine's context (`rollout.max_model_len` or prompt + response) exceeds `limit`."""
    if _long_context_allowed(cfg):
        return
    r = cfg.rollout
    if r.max_model_len is not None:
        if r.max_model_len > limit:
            problems.append(f"rollout.max_model_len: {r.max_model_len} tokens, more than the model's context of "
                            f"{limit:.0f} ({source}, model.path {cfg.model.path}); lower it")
        return
    prompt, response = cfg.longest_prompt_tokens, cfg.longest_turn_tokens
    if prompt + response > limit:
        prompt_field = ("data.max_prompt_tokens" if prompt == cfg.data.max_prompt_tokens
                        else "eval.sets' max_prompt_tokens")
        response_field = ("rollout.sampling.max_new_tokens" if response == r.sampling.max_new_tokens
                          else "eval.sampling.max_new_tokens")
        problems.append(f"{response_field}: {prompt_field} + {response_field} = {prompt} + {response} = "
                        f"{prompt + response} tokens, more than the model's context of {limit:.0f} ({source}, "
                        f"model.path {cfg.model.path}); lower either")


def _long_context_allowed(cfg: Config) -> bool:
    # vLLM's own escape hatch: with it set, the engine accepts a max_model_len beyond the model's context.
    value = cfg.cluster.actor_env.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN", os.environ.get("VLLM_ALLOW_LONG_MAX_MODEL_LEN"))
    return (value or "0").strip().lower() in ("1", "true")


# ------------------------------------------------------------------------------------------ data, reward, outputs
def _standards(cfg: Config, problems: list[str]) -> set[str]:
    """Adapters to other standards (`distrl.standards`) that the config names and whose package is not installed,
    one line each with the pip line; returns the sections naming one (their rows are not read then: each would
    fail on the same missing package)."""
    from distrl.standards import missing

    absent = set()
    for name, section in (("data", cfg.data), ("env", cfg.env), ("reward", cfg.reward), ("eval", cfg.eval)):
        lines = missing(section.model_dump(by_alias=True), name) if section is not None else []
        if lines:
            absent.add(name)
            problems.extend(lines)
    return absent


def _data(data: DataConfig, tokenizer, problems: list[str]) -> None:
    """Every row holds the prompt's columns (or `data.prompt`'s template fills), the answer and the reward columns;
    the first prompts that need the chat template render with it."""
    try:
        _, needs_template = check_rows(data, tokenizer)
    except DataError as err:
        problems.append(f"{err.field}: {err}")
        return
    if needs_template and tokenizer is not None and tokenizer.chat_template is None:
        problems.append(f"data.chat_template: prompts in {data.source} need a chat template (chat messages, "
                        f"data.chat_template 'always', or data.system_prompt) and the tokenizer has none; use "
                        f"plain-string prompts with data.chat_template 'auto' or 'never'")


def _eval(cfg: Config, problems: list[str]) -> None:
    """Every held-out set reads as `data` does, and its own reward function resolves (an environment job is scored
    by its environment)."""
    from distrl.workers.rewards import resolve_reward

    for i, s in enumerate(cfg.eval.sets if cfg.eval is not None else []):
        field = f"eval.sets[{i}] ({s.name})"
        try:
            check_rows(s)
        except DataError as err:
            # The data section's checks name its fields; here they are this set's.
            problems.append(f"{err.field.replace('data.', f'eval.sets[{i}].', 1)} ({s.name}): "
                            f"{str(err).replace('data.', f'eval.sets[{i}].')}")
        if s.reward is None:
            continue
        if cfg.env is not None:
            problems.append(f"{field}.reward: an environment job's episodes are scored by the environment; leave "
                            f"it out")
            continue
        try:
            resolve_reward(s.reward)
        except ValueError as err:
            problems.append(f"{field}.reward: {err}")


def _reward(reward: RewardConfig, problems: list[str]) -> None:
    from distrl.workers.rewards import resolve_reward

    try:
        resolve_reward(reward.function)
    except ValueError as err:
        problems.append(f"reward.function: {err}")


def _env(env: EnvConfig, problems: list[str]) -> None:
    """The environment class (or agent function) resolves, has the protocol's coroutines, and takes
    `env.kwargs`."""
    import inspect

    from distrl.agents.agent import resolve_agent
    from distrl.agents.env import resolve_env

    field, spec = ("env.agent", env.agent) if env.agent is not None else ("env.class", env.cls)
    assert spec is not None
    try:
        target = resolve_agent(spec) if env.agent is not None else resolve_env(spec)
    except ValueError as err:
        problems.append(f"{field}: {err}")
        return
    if env.tool_parser is not None:
        from distrl.agents.tool_calls import known_tool_parsers

        known = known_tool_parsers()
        if known is not None and env.tool_parser not in known:
            problems.append(f"env.tool_parser: {env.tool_parser!r} is not one of vLLM's tool parsers: "
                            f"{', '.join(sorted(known))}")
    leading = (None, None) if env.agent is not None else ()  # an agent's client and row come first
    try:
        inspect.signature(target).bind(*leading, **env.kwargs)
    except TypeError as err:
        problems.append(f"env.kwargs: {spec} does not take {sorted(env.kwargs)}: {err}")


def _run_dir(run: RunConfig, problems: list[str]) -> None:
    """RUN_DIR can be made (or is a directory) and written, and holds no run that resume/overwrite do not cover;
    in a Ray job, `run.output_dir` is absolute."""
    if os.environ.get(RAY_JOB_ENV) and not Path(run.output_dir).is_absolute():
        # The job's working directory is a temporary copy per node: checkpoints written there by learner 0 are
        # invisible to the driver (a resume would find none) and are deleted with the job.
        problems.append(f"run.output_dir: '{run.output_dir}' is relative, and in a Ray job it would resolve inside "
                        f"each node's temporary copy of the working directory ({Path.cwd()} here), where the "
                        f"driver cannot see learner 0's checkpoints and the job's end deletes them. Set an absolute "
                        f"path on storage every node mounts, e.g. --set run.output_dir=/shared/runs")
        return
    path = Path(run.output_dir) / run.name
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        field = "run.name" if existing == path else "run.output_dir"
        problems.append(f"{field}: {existing} is a file, so the run directory {path} cannot be made")
        return
    if not os.access(existing, os.W_OK | os.X_OK):
        problems.append(f"run.output_dir: no permission to write in {existing}, where the run directory {path} "
                        f"would be")
        return
    problem = reuse_problem(path, run)
    if problem:
        problems.append(problem)


# ----------------------------------------------------------------------------------------------------- resources
def _resources(cfg: Config, problems: list[str]) -> None:
    """On the embedded cluster (this machine), the roles' CPUs and GPUs fit in what Ray will find here: otherwise
    their placement groups would wait for resources that never come. (`cluster.num_cpus`, when set, is checked
    with the config; a joined cluster's nodes are only known once connected.)"""
    c = cfg.cluster
    if c.backend != "ray" or c.address or os.environ.get("RAY_ADDRESS") or os.environ.get(RAY_JOB_ENV):
        return
    if c.num_cpus is None:
        problem = cfg.unplaceable(cpu_count(), "this machine's CPU count (cluster.num_cpus unset)", "num_cpus")
        if problem:
            problems.append(f"cluster: {problem}; lower the reservations or set cluster.num_cpus")
    import torch

    problem = cfg.unplaceable(torch.cuda.device_count(), "this machine's GPU count", "num_gpus")
    if problem:
        problems.append(f"cluster: {problem}; set the roles' num_gpus to what this machine has, or join a cluster "
                        f"with GPUs (cluster.address)")


def cpu_count() -> int:
    """CPUs this process may use, as Ray counts them for its own node: those it is allowed to run on, fewer under a
    cgroup v2 CPU quota (a container's `--cpus`), rounded up. Read here so that validation imports no Ray."""
    allowed = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return allowed
    return allowed if quota == "max" else min(allowed, math.ceil(int(quota) / int(period)))


def _relative_note(path: str) -> str:
    return "" if Path(path).is_absolute() else f" (relative to the working directory {Path.cwd()})"


def _one_line(err: Exception) -> str:
    return " ".join(str(err).split())
