"""`distrl.merging`: each rule on hand-worked parts."""

import pytest

from distrl.merging import Figure, Merge, figures, merge, over_steps, values


def parts(*rows: dict[str, tuple[float, Merge]]) -> list[dict[str, Figure]]:
    return [{k: Figure(v, m) for k, (v, m) in row.items()} for row in rows]


def test_each_rule_merges_parts_of_one_batch():
    a = {"clip": (0.5, Merge.TOKEN_MEAN), "loss": (0.25, Merge.SUM), "norm": (2.0, Merge.MEAN),
         "lo": (-1.0, Merge.MIN), "hi": (3.0, Merge.MAX)}
    b = {"clip": (0.0, Merge.TOKEN_MEAN), "loss": (0.5, Merge.SUM), "norm": (4.0, Merge.MEAN),
         "lo": (-9.0, Merge.MIN), "hi": (9.0, Merge.MAX)}
    c = {"clip": (1.0, Merge.TOKEN_MEAN), "loss": (0.0, Merge.SUM), "norm": (6.0, Merge.MEAN),
         "lo": (-5.0, Merge.MIN), "hi": (1.0, Merge.MAX)}
    # c has no tokens: it adds nothing to the token mean and its extremes are not real values.
    merged = values(merge(parts(a, b, c), [3.0, 1.0, 0.0]))
    assert merged == {"clip": pytest.approx((3 * 0.5 + 1 * 0.0) / 4), "loss": 0.75, "norm": 4.0, "lo": -9.0,
                      "hi": 9.0}


def test_parts_without_tokens_fall_back_to_plain_means_and_all_extremes():
    merged = values(merge(parts({"x": (1.0, Merge.TOKEN_MEAN), "m": (2.0, Merge.MIN)},
                                {"x": (3.0, Merge.TOKEN_MEAN), "m": (-2.0, Merge.MIN)}), [0.0, 0.0]))
    assert merged == {"x": 2.0, "m": -2.0}


def test_repeated_steps_average_sums_and_report_them_as_means():
    steps = parts({"loss": (1.0, Merge.SUM), "clip": (0.2, Merge.TOKEN_MEAN)},
                  {"loss": (3.0, Merge.SUM), "clip": (0.6, Merge.TOKEN_MEAN)})
    merged = over_steps(steps, [1.0, 3.0])
    assert merged["loss"] == Figure(2.0, Merge.MEAN)
    assert merged["clip"] == Figure(pytest.approx(0.5), Merge.TOKEN_MEAN)


def test_parts_that_disagree_are_refused():
    with pytest.raises(ValueError, match="part 1 reports"):
        merge(parts({"x": (1.0, Merge.SUM)}, {"y": (1.0, Merge.SUM)}), [1.0, 1.0])
    with pytest.raises(ValueError, match="'x' merges by sum in part 0 but by mean in part 1"):
        merge(parts({"x": (1.0, Merge.SUM)}, {"x": (1.0, Merge.MEAN)}), [1.0, 1.0])
    with pytest.raises(ValueError, match="2 parts but 1 token counts"):
        merge(parts({"x": (1.0, Merge.SUM)}, {"x": (1.0, Merge.SUM)}), [1.0])


def test_figures_labels_plain_values():
    assert figures({"a": 1, "b": 2.5}, Merge.SUM) == {"a": Figure(1.0, Merge.SUM), "b": Figure(2.5, Merge.SUM)}
    assert merge([], []) == {}
