"""Weight fingerprints: hand-worked checksums, the fixed column sample, and what a mismatch report names."""

import pytest
import torch

from distrl.workers.weights.fingerprint import (
    SAMPLE_COLUMNS,
    add,
    columns,
    first_mismatch,
    key,
    of_blocks,
    of_rows,
    of_sample,
    of_tensors,
    sample,
)


def splitmix64_top16(i: int) -> int:
    """The reference of the position hash, in Python integers: splitmix64's finaliser, top 16 bits."""
    mask = (1 << 64) - 1
    z = ((i ^ (i >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 48


def test_checksum_weighs_each_entry_by_its_position():
    # Position weights 1 + top16(splitmix64(r * S + c)) / 65536; for a [2, 2] sample the hashes of 0, 1, 2, 3 are
    # 0, 22162, 56274 and 7763.
    assert [splitmix64_top16(i) for i in range(4)] == [0, 22162, 56274, 7763]
    w00, w01, w10, w11 = 1.0, 1 + 22162 / 65536, 1 + 56274 / 65536, 1 + 7763 / 65536
    checksum, scale = of_sample(torch.tensor([[1.0, 2.0], [3.0, -4.0]]))
    assert checksum == pytest.approx(1 * w00 + 2 * w01 + 3 * w10 - 4 * w11, rel=1e-15)
    assert scale == pytest.approx(1 * w00 + 2 * w01 + 3 * w10 + 4 * w11, rel=1e-15)


def test_rows_far_apart_get_different_weights():
    """A vocabulary has more than 65536 rows: rows 2**16 apart must not share weights (a linear hash mod 2**16
    would make swapping them invisible)."""
    rows = torch.zeros(70_000, 1)
    rows[3], rows[3 + 65536] = 1.0, 2.0
    swapped = rows.clone()
    swapped[[3, 3 + 65536]] = rows[[3 + 65536, 3]]
    assert of_sample(swapped)[0] != of_sample(rows)[0]


def test_swapped_rows_or_columns_change_the_checksum():
    values = torch.tensor([[1.0, 2.0], [3.0, -4.0]])
    assert of_sample(values.flip(0))[0] != of_sample(values)[0]
    assert of_sample(values.flip(1))[0] != of_sample(values)[0]


def test_the_column_sample_is_fixed_by_the_width():
    assert columns(5).tolist() == [0, 1, 2, 3, 4]
    picked = columns(1000)
    assert len(picked) == SAMPLE_COLUMNS == len(set(picked.tolist()))
    assert picked.tolist() == sorted(picked.tolist()) and picked.tolist() == columns(1000).tolist()
    assert picked.min() >= 0 and picked.max() < 1000


def test_sample_takes_every_row():
    weight = torch.arange(40.0).reshape(4, 10)
    assert sample(weight).shape == (4, SAMPLE_COLUMNS)
    assert torch.equal(sample(weight)[:, 0], weight[:, columns(10)[0]])
    assert torch.equal(sample(torch.tensor([1.0, 2.0])), torch.tensor([[1.0], [2.0]]))
    assert sample(torch.zeros(3, 2, 5)).shape == (3, SAMPLE_COLUMNS)  # [3, 10] after flattening


def test_a_mismatch_names_the_first_tensor_that_differs_and_counts_them():
    torch.manual_seed(0)
    weights = {"a.weight": torch.randn(16, 32), "b.weight": torch.randn(16, 32), "b.bias": torch.randn(16)}
    expected = of_tensors(weights.items(), torch.float32)
    assert first_mismatch(expected, of_tensors(weights.items(), torch.float32)) is None
    stale = {**weights, "b.weight": weights["b.weight"].clone(), "b.bias": weights["b.bias"] + 1e-3}
    stale["b.weight"][7, columns(32)[3]] += 1e-3  # one entry, in a sampled column
    found = first_mismatch(expected, of_tensors(stale.items(), torch.float32))
    assert found is not None
    assert found.startswith("b.weight differs (checksum ") and found.endswith("; 2 of 3 tensors differ")
    missing = of_tensors([(k, v) for k, v in weights.items() if k != "a.weight"], torch.float32)
    assert first_mismatch(expected, missing) == "a.weight is not among the tensors it serves; 1 of 3 tensors differ"
    extra = {**of_tensors(weights.items(), torch.float32), "rotary.cache": (1.0, 1.0)}
    assert first_mismatch(expected, extra) is None  # what the engine holds beyond the learner's tensors is its own


def test_the_fingerprint_is_of_the_weights_as_sent_in_the_rollout_dtype():
    weight = torch.tensor([[1.0 + 2**-12, 1.0]])  # bfloat16 keeps 8 bits of mantissa: 1 + 2**-12 rounds to 1
    assert of_tensors([("w", weight)], torch.bfloat16) == of_tensors([("w", torch.ones(1, 2))], torch.bfloat16)
    assert of_tensors([("w", weight)], torch.float32) != of_tensors([("w", torch.ones(1, 2))], torch.float32)


# ------------------------------------------------------------------------- regions and the learners' parts of them
# Position weights of a sample's positions 0..3 (the hashes of the first test): 1 + top16 / 65536.
W = [1.0, 1 + 22162 / 65536, 1 + 56274 / 65536, 1 + 7763 / 65536]
T = torch.tensor([[1.0, 2.0], [3.0, -4.0], [5.0, 6.0]])


def test_a_region_of_rows_is_fingerprinted_as_a_tensor_of_its_own():
    # Rows 1-2 of T, [[3, -4], [5, 6]], sampled at positions 0..3: 3 w0 - 4 w1 + 5 w2 + 6 w3.
    checksum, scale = of_rows(T, 0, 3, (0, 1, 2))
    assert checksum == pytest.approx(3 * W[0] - 4 * W[1] + 5 * W[2] + 6 * W[3], rel=1e-15)
    assert scale == pytest.approx(3 * W[0] + 4 * W[1] + 5 * W[2] + 6 * W[3], rel=1e-15)
    assert (checksum, scale) == of_sample(sample(T[1:3]))  # what a worker holding those rows computes
    assert key("w", (0, 1, 2)) == "w[0:1:2]" and key("w", None) == "w"


def test_a_block_of_rows_holds_its_part_of_a_region_and_the_parts_add_up():
    # A learner holding row 2 alone: 5 w2 + 6 w3 (row 2 is the region's second row); one holding row 0: nothing.
    assert of_rows(T[2:], 2, 3, (0, 1, 2)) == pytest.approx((5 * W[2] + 6 * W[3], 5 * W[2] + 6 * W[3]), rel=1e-15)
    assert of_rows(T[:1], 0, 3, (0, 1, 2)) == (0.0, 0.0)
    whole = of_sample(sample(T))
    parts = [of_rows(T[:2], 0, 3, None), of_rows(T[2:], 2, 3, None)]
    assert sum(p[0] for p in parts) == pytest.approx(whole[0], rel=1e-15)
    assert of_rows(T, 0, 3, None) == whole  # one block of every row: exactly the whole tensor's


def test_a_region_of_columns_is_every_rows_block_of_those_columns():
    # Column 1 of T, [[2], [-4], [6]], sampled at positions 0, 1, 2 (one column): 2 w0 - 4 w1 + 6 w2.
    checksum, _ = of_rows(T, 0, 3, (1, 1, 1))
    assert checksum == pytest.approx(2 * W[0] - 4 * W[1] + 6 * W[2], rel=1e-15)
    split = [of_rows(T[:1], 0, 3, (1, 1, 1)), of_rows(T[1:], 1, 3, (1, 1, 1))]
    assert split[0][0] == pytest.approx(2 * W[0]) and split[1][0] == pytest.approx(-4 * W[1] + 6 * W[2])


def test_the_learners_blocks_give_the_fingerprint_of_every_region_asked_for():
    regions = {"w": [(0, 0, 2), (0, 2, 1)], "b": [None]}
    learner0 = of_blocks([("w", T[:2], 0, 3), ("b", torch.tensor(7.0), 0, 1)], regions, torch.float32)
    learner1 = of_blocks([("w", T[2:], 2, 3), ("unasked", T, 0, 3)], regions, torch.float32)
    total = add([learner0, learner1])
    assert set(total) == {"w[0:0:2]", "w[0:2:1]", "b"}
    assert total["w[0:0:2]"] == of_sample(sample(T[:2])) and total["w[0:2:1]"] == of_sample(sample(T[2:]))
    assert total["b"] == of_sample(sample(torch.tensor([7.0])))  # a 0-dim tensor is one row
    assert of_blocks([("w", T, 0, 3)], None, torch.float32) == {"w": of_sample(sample(T))}  # TP 1: whole tensors


def test_a_region_of_a_later_dimension_is_every_experts_block_of_it():
    """A stack of experts `[E, out, in]` cut along `in` (an expert's down projection at TP 2): the region (2, 1, 1)
    of a [2, 1, 2] stack is [[[2]], [[4]]], sampled at positions 0 and 1: 2 w0 + 4 w1; learners holding one expert
    each hold one term."""
    stack = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    checksum, _ = of_rows(stack, 0, 2, (2, 1, 1))
    assert checksum == pytest.approx(2 * W[0] + 4 * W[1], rel=1e-15)
    assert checksum == of_sample(sample(stack[:, :, 1:]))[0]  # what a worker holding that block computes
    parts = [of_rows(stack[:1], 0, 2, (2, 1, 1))[0], of_rows(stack[1:], 1, 2, (2, 1, 1))[0]]
    assert parts == pytest.approx([2 * W[0], 4 * W[1]], rel=1e-15)


def test_one_tensor_may_have_several_regions_on_one_worker():
    # The gate rows 0 and up rows 2 of a [1, 4, 1] gate_up stack (I = 2, the first of two workers): two keys.
    stack = torch.tensor([[[1.0], [2.0], [3.0], [4.0]]])
    regions = {"gate_up": [(1, 0, 1), (1, 2, 1)]}
    got = of_blocks([("gate_up", stack, 0, 1)], regions, torch.float32)
    assert got == {"gate_up[1:0:1]": (1.0, 1.0), "gate_up[1:2:1]": (3.0, 3.0)}  # one entry each: weight w0 = 1
