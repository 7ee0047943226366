"""reasoning-gym's procedural tasks as data, scored by the tasks' own `score_answer`.

    data:   {function: distrl.standards.reasoning_gym:rows, kwargs: {tasks: [leg_counting], size: 2000, seed: 1}}
    reward: {function: distrl.standards.reasoning_gym:score}
    eval:   {sets: [{name: held_out, function: distrl.standards.reasoning_gym:rows,
                     kwargs: {tasks: [leg_counting], size: 200, seed: 2}}]}

`rows` asks reasoning-gym's generators for `size` entries (`create_dataset(name, size=, seed=, **config)`; several
tasks are drawn by weight as its `composite` dataset draws them) and makes each a row: the question as the prompt,
after a system prompt that asks for the answer between `<answer>` tags (reasoning-gym's own `SYSTEM_PROMPTS`), the
entry's answer and metadata, and the task and config that made it. `score` extracts the answer from the tags
(`reasoning_gym.utils.extract_answer`) and returns what the task's `score_answer` gives it, from a dataset built
with the same config (a task's scorer may read its config). A held-out set is the same generator with another
seed. In an environment job (a mixture), `distrl.agents.envs:ToolEnvironment` with no tools and `reward: score`
plays the same single turn.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from distrl.standards import require

DEFAULT_SYSTEM_PROMPT = "default"
"""The key of reasoning-gym's `SYSTEM_PROMPTS` used unless `rows` is given another (or a text, or null)."""


def _tasks(tasks: str | list[str | dict[str, Any]]) -> list[dict[str, Any]]:
    """`tasks` as `[{"name", "weight", "config"}]`: a name, or a list of names and `{name, weight, config}`."""
    out = []
    for task in [tasks] if isinstance(tasks, str) else tasks:
        spec: dict[str, Any] = {"name": task} if isinstance(task, str) else dict(task)
        unknown = set(spec) - {"name", "weight", "config"}
        if "name" not in spec or unknown:
            raise ValueError(f"a task is a name or {{name, weight, config}}, got {task!r}")
        out.append({"name": spec["name"], "weight": float(spec.get("weight", 1.0)),
                    "config": dict(spec.get("config") or {})})
    if not out:
        raise ValueError("tasks names no task")
    return out


def rows(tasks: str | list[str | dict[str, Any]], size: int = 1000, seed: int = 0,
         system_prompt: str | None = DEFAULT_SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """`size` rows of reasoning-gym's `tasks` (a task name, or a list of names and `{name, weight, config}`: the
    config as the task's config class takes it), generated with `seed`. `system_prompt`: a key of
    reasoning-gym's `SYSTEM_PROMPTS` ("default", "direct", ...), a text of one's own, or null (the question
    alone, as a plain prompt)."""
    rg = require("reasoning_gym")
    from reasoning_gym.utils import SYSTEM_PROMPTS

    specs = _tasks(tasks)
    if len(specs) == 1:
        dataset = rg.create_dataset(specs[0]["name"], size=size, seed=seed, **specs[0]["config"])
    else:
        from reasoning_gym.composite import DatasetSpec

        dataset = rg.create_dataset("composite", size=size, seed=seed,
                                    datasets=[DatasetSpec(s["name"], s["weight"], s["config"]) for s in specs])
    configs = {s["name"]: s["config"] for s in specs}
    system = SYSTEM_PROMPTS.get(system_prompt, system_prompt) if system_prompt is not None else None
    out = []
    for entry in dataset:
        task = entry["metadata"]["source_dataset"] if len(specs) > 1 else specs[0]["name"]
        question = entry["question"]
        prompt: str | list[dict[str, str]] = (question if system is None else
                                              [{"role": "system", "content": system},
                                               {"role": "user", "content": question}])
        out.append({"prompt": prompt, "answer": str(entry["answer"]), "metadata": entry["metadata"],
                    "task": task, "task_config": configs[task]})
    return out


def score(prompt: str, completion: str, sample: dict[str, Any]) -> dict[str, Any]:
    """The task's own `score_answer` on the answer between the completion's last `<answer>` tags (None when there
    is none, which the tasks score 0), as `{"reward", "answer", "task"}`."""
    require("reasoning_gym")
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(completion, tag_name="answer")
    entry = {"question": prompt, "answer": sample["answer"], "metadata": sample["metadata"]}
    dataset = _scorer(sample["task"], json.dumps(sample.get("task_config") or {}, sort_keys=True))
    return {"reward": float(dataset.score_answer(answer, entry)), "answer": answer, "task": sample["task"]}


@cache
def _scorer(task: str, config: str) -> Any:
    """A dataset of `task` with `config` (JSON) whose `score_answer` scores its entries: one per process."""
    import reasoning_gym

    return reasoning_gym.create_dataset(task, **json.loads(config))

