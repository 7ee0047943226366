"""Weight fingerprints: hand-worked checksums, the fixed column sample, and what a mismatch report names."""

import pytest
import torch

from distrl.workers.weights.fingerprint import SAMPLE_COLUMNS, columns, first_mismatch, of_sample, of_tensors, sample


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
