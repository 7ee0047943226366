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
