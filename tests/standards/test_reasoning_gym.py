"""reasoning-gym's tasks as data and their own scorers as the reward."""

from __future__ import annotations

import pytest

from distrl.standards import reasoning_gym as adapter

pytest.importorskip("reasoning_gym")


def test_rows_are_the_generators_entries_with_its_answer_and_what_made_them():
    import reasoning_gym

    rows = adapter.rows("leg_counting", size=3, seed=7)
    entries = list(reasoning_gym.create_dataset("leg_counting", size=3, seed=7))
    assert [r["answer"] for r in rows] == [e["answer"] for e in entries]
    assert rows[0]["prompt"][0] == {"role": "system", "content": reasoning_gym.utils.SYSTEM_PROMPTS["default"]}
    assert rows[0]["prompt"][1] == {"role": "user", "content": entries[0]["question"]}
    assert (rows[0]["task"], rows[0]["task_config"]) == ("leg_counting", {})
    # Another seed is another set: the held-out set of the same generator.
    assert [r["answer"] for r in adapter.rows("leg_counting", size=3, seed=8)] != [r["answer"] for r in rows]
    assert adapter.rows("leg_counting", size=1, seed=7, system_prompt=None)[0]["prompt"] == entries[0]["question"]


def test_several_tasks_are_drawn_by_weight_with_their_configs():
    tasks = ["basic_arithmetic", {"name": "leg_counting", "weight": 3, "config": {"min_animals": 2, "max_animals": 2}}]
    rows = adapter.rows(tasks, size=40, seed=1)
    names = [r["task"] for r in rows]
    assert set(names) == {"basic_arithmetic", "leg_counting"} and names.count("leg_counting") > 20
    legs = [r for r in rows if r["task"] == "leg_counting"]
    assert all(r["metadata"]["num_animals"] == 2 and r["task_config"]["min_animals"] == 2 for r in legs)
    with pytest.raises(ValueError, match="a task is a name or"):
        adapter.rows([{"task": "leg_counting"}])


def test_the_score_is_the_tasks_own_score_of_the_tagged_answer():
    [row] = adapter.rows("basic_arithmetic", size=1, seed=3)
    right = adapter.score("", f"Thinking... <answer> {row['answer']} </answer>", row)
    assert right == {"reward": 1.0, "answer": row["answer"], "task": "basic_arithmetic"}
    assert adapter.score("", f"{row['answer']} without tags", row)["reward"] == 0.0
    assert adapter.score("", "<answer>-1e99</answer>", row)["reward"] == 0.0
    # The last tagged answer counts.
    assert adapter.score("", f"<answer>0</answer> no, <answer>{row['answer']}</answer>", row)["reward"] == 1.0


def test_a_held_out_set_is_another_seed_range_not_another_seed():
    # reasoning-gym draws entry i from Random(seed + i): the set of seed 2 is the set of seed 1 shifted by one.
    train = {"tasks": ["leg_counting"], "size": 100, "seed": 1}
    questions = [r["prompt"] for r in adapter.rows(**train)]
    assert [r["prompt"] for r in adapter.rows("leg_counting", size=20, seed=2)] == questions[1:21]
    assert adapter.overlap(adapter.rows(**train), adapter.rows("leg_counting", size=20, seed=2)) == 20
    assert adapter.overlap(adapter.rows(**train), adapter.rows("leg_counting", size=20, seed=101)) == 0
    [line] = adapter.held_out_problems(train, {**train, "size": 20, "seed": 2}, "eval.sets[0] (h)", "data")
    assert line == ("eval.sets[0] (h): its reasoning-gym rows are drawn from seeds 2-21 and the training data's "
                    "(data) from seeds 1-100: reasoning-gym draws entry i of a set from seed + i, so 20 of its 20 "
                    "rows are training rows. Give it a seed from 101 on")
    assert adapter.held_out_problems(train, {**train, "seed": 101}, "h", "data") == []
    assert adapter.held_out_problems(train, {**train, "seed": -19, "size": 20}, "h", "data") == []
    assert adapter.held_out_problems(train, {**train, "seed": -19, "size": 21}, "h", "data") != []
    assert adapter.held_out_problems(train, {**train, "tasks": ["basic_arithmetic"]}, "h", "data") == []


def test_the_preflight_refuses_a_held_out_set_of_training_rows(tiny_model_dir, tmp_path):
    from distrl import preflight
    from distrl.config import from_dict

    rows = {"function": "distrl.standards.reasoning_gym:rows", "kwargs": {"tasks": ["leg_counting"], "size": 50,
                                                                         "seed": 1}}
    mixed = {"function": "distrl.standards.mixture:rows", "kwargs": {"sources": {"rg": rows}}}

    def check(data: dict, held_out_seed: int) -> list[str]:
        held_out = {**data, "kwargs": {"sources": {"rg": {**rows, "kwargs": {**rows["kwargs"], "seed": held_out_seed}}}}
                    if data is mixed else {**rows["kwargs"], "seed": held_out_seed}}
        cfg = from_dict({"model": {"path": str(tiny_model_dir)}, "data": data,
                         "reward": {"function": "distrl.standards.reasoning_gym:score"},
                         "eval": {"sets": [{"name": "held_out", **held_out}]},
                         "run": {"output_dir": str(tmp_path)}, "cluster": {"backend": "local"}})
        try:
            preflight.check(cfg)
        except preflight.PreflightError as err:
            return err.problems
        return []

    [line] = check(rows, 2)
    assert line.startswith("eval.sets[0] (held_out): its reasoning-gym rows are drawn from seeds 2-51 and the "
                           "training data's (data) from seeds 1-50")
    [line] = check(mixed, 50)
    assert line.startswith("eval.sets[0] (held_out).kwargs.sources.rg: its reasoning-gym rows are drawn from seeds "
                           "50-99 and the training data's (data.kwargs.sources.rg) from seeds 1-50")
    assert check(rows, 51) == [] and check(mixed, 51) == []
