import pytest

from distrl.cluster.batch_stats import token_age_metrics


def test_trained_tokens_are_shared_out_by_age_one_bucket_per_age_up_to_4():
    """Step 6 updates from version 5. Sample 0's trained tokens were sampled by versions [5, 4, 3] (ages 0, 1, 2; its
    last token, version 1, is not trained), sample 1's by [2, 1, 0, 0] (ages 3, 4, 5, 5): 7 tokens, ages 0, 1, 2, 3
    one each and 4+ three. Versions spanned: 5 - 3 + 1 = 3 and 2 - 0 + 1 = 3."""
    figures = token_age_metrics([[5, 4, 3, 1], [2, 1, 0, 0]], [[1, 1, 1, 0], [1, 1, 1, 1]], step=6)
    assert figures == {"tokens/age_0_share": pytest.approx(1 / 7), "tokens/age_1_share": pytest.approx(1 / 7),
                       "tokens/age_2_share": pytest.approx(1 / 7), "tokens/age_3_share": pytest.approx(1 / 7),
                       "tokens/age_4+_share": pytest.approx(3 / 7), "tokens/versions_spanned_mean": 3.0,
                       "tokens/versions_spanned_max": 3.0}
