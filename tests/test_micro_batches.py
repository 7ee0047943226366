"""Micro-batch formation (`distrl.micro_batches`): hand-worked token-budget groups (first-fit decreasing's count,
then balanced longest first), the fixed count, and the `min_count` that keeps sharded learners in lockstep."""

import pytest

from distrl.micro_batches import at_least, balanced, fixed_count, micro_batches, token_budget


def test_fixed_count_is_consecutive_rows():
    assert fixed_count(5, 2) == [[0, 1], [2, 3], [4]]
    assert micro_batches([9, 9, 9, 9, 9], micro_batch_size=2) == [[0, 1], [2, 3], [4]]


def test_token_budget_takes_first_fit_decreasings_count_then_balances():
    # lengths 30 50 20 70 40, budget 100. First-fit decreasing, 70(r3) 50(r1) 40(r4) 30(r0) 20(r2): A = 70 + 30,
    # B = 50 + 40, C = 20: three groups (loads 100, 90, 20). Dealt again over three, longest first, each to the
    # lightest: 70 -> A, 50 -> B, 40 -> C, 30 -> C (70), 20 -> B (70): loads 70, 70, 70.
    assert token_budget([30, 50, 20, 70, 40], 100) == [[3], [1, 2], [0, 4]]


def test_balancing_spreads_a_tail_of_short_rows():
    # First-fit decreasing puts the three 10s beside the first 60 (90, 60, 60); balanced: 70, 70, 70.
    assert token_budget([60, 60, 60, 10, 10, 10], 100) == [[0, 3], [1, 4], [2, 5]]
    assert balanced([5, 1, 4], 2) == [[0], [1, 2]]  # 5 -> A, 4 -> B, 1 -> B (5): ties go to the first


def test_balancing_takes_more_groups_when_the_balanced_ones_overflow():
    # 40 40 30 30 30, budget 90: first-fit decreasing makes 2 groups (40 + 40, 30 + 30 + 30), but dealt over two
    # the loads are 40 + 30 + 30 = 100 > 90 and 70. Over three: 40 -> A, 40 -> B, 30 -> C, 30 -> C (60),
    # 30 -> A (70): loads 70, 40, 60.
    assert token_budget([40, 40, 30, 30, 30], 90) == [[0, 4], [1], [2, 3]]


def test_a_row_longer_than_the_budget_goes_alone():
    # 150 > 100 opens its own group and nothing fits beside it; 60 + 40 fill the next one exactly.
    assert token_budget([60, 150, 40], 100) == [[1], [0, 2]]


def test_equal_lengths_keep_row_order():
    assert token_budget([10, 10, 10, 10], 20) == [[0, 2], [1, 3]]


def test_every_row_once_and_no_group_over_budget():
    lengths = [(7 * i) % 23 + 1 for i in range(40)]
    groups = micro_batches(lengths, micro_batch_size=4, max_tokens=30)
    assert sorted(i for g in groups for i in g) == list(range(40))
    assert all(sum(lengths[i] for i in g) <= 30 for g in groups)


def test_min_count_halves_the_fullest_group_first():
    # Budget 100 gives [[3], [1, 2], [0, 4]], 70 tokens each (see above). min_count 4: the first of the fullest
    # groups of two rows, {1: 50, 2: 20}, splits into {1} and {2}; min_count 5: then {4: 40, 0: 30} into {4}, {0}.
    lengths = [30, 50, 20, 70, 40]
    assert micro_batches(lengths, 1, max_tokens=100, min_count=4) == [[3], [1], [2], [0, 4]]
    assert micro_batches(lengths, 1, max_tokens=100, min_count=5) == [[3], [1], [2], [4], [0]]


def test_min_count_halves_alternate_by_length():
    # One group of four rows, lengths 1 4 2 3: by length 4(r1) 3(r3) 2(r2) 1(r0); halves take every other one,
    # {r1, r2} (6 tokens) and {r3, r0} (4 tokens).
    assert at_least([[0, 1, 2, 3]], [1, 4, 2, 3], 2) == [[1, 2], [0, 3]]


def test_min_count_adds_empty_groups_once_every_group_has_one_row():
    assert micro_batches([5, 6], micro_batch_size=1, min_count=4) == [[0], [1], [], []]
    assert micro_batches([], micro_batch_size=2, min_count=2) == [[], []]


def test_bad_arguments_name_the_setting():
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        token_budget([1, 2], 0)
    with pytest.raises(ValueError, match="micro_batch_size"):
        fixed_count(3, 0)
    with pytest.raises(ValueError, match="min_count"):
        micro_batches([1], 1, min_count=0)
