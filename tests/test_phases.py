"""The phases' shares of work with sequence-parallel learners (`learner.sequence_parallel_size` k): the batch is
split over the data-parallel groups, each group's k learners get the same part, and a group answers once."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from test_learner import batch

from distrl.loop.phases import one_per_group, start_update
from distrl.metrics import BusyClock


class Learners:
    """A learner group that records the shards each call was given."""

    def __init__(self, n: int):
        self.n, self.shards = n, []

    def __len__(self) -> int:
        return self.n

    def map_shards(self, method, shards):
        self.shards = list(shards)
        return [f"call {i}" for i in range(len(shards))]


def job(learners: int, k: int):
    return SimpleNamespace(cfg=SimpleNamespace(learner=SimpleNamespace(sequence_parallel_size=k), mini_batches=1),
                           roles=SimpleNamespace(learner=Learners(learners), critic=None), learner_clock=BusyClock())


def test_the_learners_of_a_group_get_the_same_part_and_answer_once():
    four_by_two = job(4, 2)  # 2 data-parallel groups: learners (0, 1) and (2, 3)
    updating = start_update(four_by_two, batch())
    shards = four_by_two.roles.learner.shards
    assert len(shards) == 4 and len(updating.learner_rows) == 2
    ids = [s.sequences.input_ids for s in shards]
    assert torch.equal(ids[0], ids[1]) and torch.equal(ids[2], ids[3]) and ids[0].shape[0] == 4
    assert sorted(torch.cat(updating.learner_rows).tolist()) == list(range(8))  # every row once over the groups
    assert one_per_group(four_by_two, ["a0", "a1", "b0", "b1"]) == ["a0", "b0"]
    # Without sequence parallelism every learner is its own group (negative control: 4 different parts).
    plain = job(4, 1)
    start_update(plain, batch())
    assert [s.batch_size for s in plain.roles.learner.shards] == [2, 2, 2, 2]
    assert one_per_group(plain, ["a", "b", "c", "d"]) == ["a", "b", "c", "d"]
