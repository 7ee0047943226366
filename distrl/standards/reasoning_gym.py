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
seed range. In an environment job (a mixture), `distrl.agents.envs:ToolEnvironment` with no tools and `reward:
score` plays the same single turn.

reasoning-gym draws entry i of a set from `Random(seed + i)`: a set of `size` rows with `seed` s is the entries of
seeds s to s + size - 1, and the set of seed s + 1 is the same rows shifted by one. A held-out set is another seed
*range*: `held_out_problems` names the held-out sets whose range meets the training data's (the preflight refuses
them). A task with few distinct questions repeats them in any two ranges; the held-out figure of such a task is not
a held-out figure (`overlap` counts the questions two sets share).
"""

from __future__ import annotations

import json
from functools import cache
from typing import Any

from distrl.standards import require

ROWS = "distrl.standards.reasoning_gym:rows"
DEFAULT_SIZE, DEFAULT_SEED = 1000, 0
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


def rows(tasks: str | list[str | dict[str, Any]], size: int = DEFAULT_SIZE, seed: int = DEFAULT_SEED,
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


def seed_range(kwargs: dict[str, Any]) -> range:
    """The generator seeds of the entries that `rows(**kwargs)` makes."""
    seed, size = kwargs.get("seed", DEFAULT_SEED), kwargs.get("size", DEFAULT_SIZE)
    return range(seed, seed + size)


def held_out_problems(training: dict[str, Any], held_out: dict[str, Any], field: str, training_field: str) -> list[str]:
    """A line if `rows(**held_out)` (at config path `field`) draws entries of the same tasks from seeds that
    `rows(**training)` (at `training_field`) draws too: those held-out rows are training rows."""
    try:
        if _tasks(training["tasks"]) != _tasks(held_out["tasks"]):
            return []
    except (KeyError, ValueError):  # not rows of tasks: the data's own checks say why
        return []
    train, held = seed_range(training), seed_range(held_out)
    shared = range(max(train.start, held.start), min(train.stop, held.stop))
    if not shared:
        return []
    return [f"{field}: its reasoning-gym rows are drawn from seeds {held.start}-{held.stop - 1} and the training "
            f"data's ({training_field}) from seeds {train.start}-{train.stop - 1}: reasoning-gym draws entry i of a "
            f"set from seed + i, so {len(shared)} of its {len(held)} rows are training rows. Give it a seed from "
            f"{train.stop} on"]


def overlap(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> int:
    """How many rows of `b` ask a question (prompt) that a row of `a` asks."""
    questions = {json.dumps(row["prompt"], sort_keys=True) for row in a}
    return sum(json.dumps(row["prompt"], sort_keys=True) in questions for row in b)


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

