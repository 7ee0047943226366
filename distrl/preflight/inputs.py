"""The preflight's checks of what a run reads and calls: the data and the held-out sets, the reward function, the
environment, and the packages of the other standards' adapters it names; each problem one line naming its field."""

from __future__ import annotations

from distrl.config import Config, DataConfig, EnvConfig, RewardConfig
from distrl.data.prompts import check_rows
from distrl.data.sources import DataError


def check_standards(cfg: Config, problems: list[str]) -> set[str]:
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


def check_held_out(cfg: Config, problems: list[str]) -> None:
    """No held-out set draws the training data's rows from a generator whose seeds say so before any row is made
    (`distrl.standards.held_out_problems`: reasoning-gym's entry i of seed s is entry i + 1 of seed s - 1)."""
    from distrl.standards.checks import held_out_problems

    if cfg.eval is not None:
        problems.extend(held_out_problems(cfg.data.model_dump(by_alias=True),
                                          [s.model_dump(by_alias=True) for s in cfg.eval.sets]))


def check_data(data: DataConfig, tokenizer, problems: list[str]) -> None:
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


def check_eval(cfg: Config, problems: list[str]) -> None:
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


def check_reward(reward: RewardConfig, problems: list[str]) -> None:
    from distrl.workers.rewards import resolve_reward

    try:
        resolve_reward(reward.function)
    except ValueError as err:
        problems.append(f"reward.function: {err}")


def check_env_adapter(env: EnvConfig, problems: list[str]) -> None:
    """What the adapter of another standard that `env.class` names can tell of its environment (`distrl.standards`:
    a verifiers environment with tools needs `env.tool_parser`)."""
    from distrl.standards.checks import env_problems

    problems.extend(env_problems(env.cls, env.kwargs, env.tool_parser))


def check_env(env: EnvConfig, problems: list[str]) -> None:
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
