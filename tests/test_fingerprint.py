"""Weight fingerprints: hand-worked checksums, the fixed column sample, and what a mismatch report names."""

import pytest
import torch

from distrl.workers.fingerprint import SAMPLE_COLUMNS, columns, first_mismatch, of_sample, of_tensors, sample


def test_checksum_weighs_each_entry_by_its_position():
    # Position weights 1 + ((2654435761 r + 2246822519 c) mod 65536) / 65536:
    #   (0,0): 1;  (0,1): 0x85EBCA77 -> 0xCA77 = 51831;  (1,0): 0x9E3779B1 -> 0x79B1 = 31153;
    #   (1,1): 0x79B1 + 0xCA77 = 0x14428 -> 0x4428 = 17448.
    w00, w01, w10, w11 = 1.0, 1 + 51831 / 65536, 1 + 31153 / 65536, 1 + 17448 / 65536
    checksum, scale = of_sample(torch.tensor([[1.0, 2.0], [3.0, -4.0]]))
    assert checksum == pytest.approx(1 * w00 + 2 * w01 + 3 * w10 - 4 * w11, rel=1e-15)
    assert scale == pytest.approx(1 * w00 + 2 * w01 + 3 * w10 + 4 * w11, rel=1e-15)


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
