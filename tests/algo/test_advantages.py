"""Group advantage estimators, token returns and GAE on hand-worked cases."""

import math

import pytest
import torch

from distrl.algo import gae, group_advantages, token_advantages, whiten_tokens

from .helpers import ragged_mask

# two groups of G = 4: [1, 0, 0, 1] (mean 0.5) and all-equal [2, 2, 2, 2]
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
# unbiased std of the first group: sqrt(4 x 0.25 / 3) = 0.57735
STD = math.sqrt(1 / 3)


@pytest.mark.parametrize(
    ("estimator", "first_group"),
    [
        ("grpo", [0.5 / STD, -0.5 / STD, -0.5 / STD, 0.5 / STD]),  # +-0.8660
        ("dr_grpo", [0.5, -0.5, -0.5, 0.5]),
        # r_i minus the mean of the other three: 1 - 1/3 = 2/3, 0 - 2/3 = -2/3
        ("rloo", [2 / 3, -2 / 3, -2 / 3, 2 / 3]),
    ],
)
def test_group_estimators(estimator, first_group):
    adv = group_advantages(REWARDS, 4, estimator, eps=0.0)
    assert adv[:4].tolist() == pytest.approx(first_group, rel=1e-6)
    assert adv[4:].tolist() == [0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"])
def test_all_equal_group_gives_exactly_zero(estimator):
    # In float32 the mean of seven 0.3s is not 0.3 (residue 3e-8, std 3e-8): without an explicit rule grpo would
    # give 3e-8 / (3e-8 + 1e-6) ~ 0.03 instead of 0. Second group [1, 0, ...] keeps the batch std non-zero.
    rewards = torch.tensor([0.3] * 7 + [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    if estimator == "reinforce_pp":  # no groups: the whole batch must be equal
        rewards = torch.full((14,), 0.3)
    adv = group_advantages(rewards, 7, estimator)
    assert adv[:7].tolist() == [0.0] * 7


def test_grpo_eps_is_added_to_the_std():
    adv = group_advantages(torch.tensor([1.0, 0.0]), 2, "grpo", eps=1.0)
    # std of [1, 0] (unbiased) = 0.7071: 0.5 / 1.7071 = 0.2929
    assert adv.tolist() == pytest.approx([0.5 / (math.sqrt(0.5) + 1), -0.5 / (math.sqrt(0.5) + 1)])


def test_reinforce_pp_whitens_over_the_batch():
    # rewards [0, 1, 2, 3]: mean 1.5, deviations [-1.5, -0.5, 0.5, 1.5], unbiased var 5/3, std 1.2910
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0, 3.0]), 2, "reinforce_pp", eps=0.0)
    std = math.sqrt(5 / 3)
    assert adv.tolist() == pytest.approx([-1.5 / std, -0.5 / std, 0.5 / std, 1.5 / std])


def test_reinforce_pp_baseline():
    # groups [0, 1] and [2, 2]: centred [-0.5, 0.5, 0, 0]; batch std sqrt(0.5 / 3) = 0.40825 -> [-1.2247, 1.2247, 0, 0]
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0, 2.0]), 2, "reinforce_pp_baseline", eps=0.0)
    assert adv.tolist() == pytest.approx([-0.5 / math.sqrt(0.5 / 3), 0.5 / math.sqrt(0.5 / 3), 0.0, 0.0])
    assert adv[2:].tolist() == [0.0, 0.0]


def test_whitening_divides_group_advantages_by_the_batch_std():
    # dr_grpo on groups [0, 1] and [2, 4]: centred [-0.5, 0.5, -1, 1] (batch mean 0);
    # unbiased batch var (0.25 + 0.25 + 1 + 1) / 3 = 5/6, std 0.91287 -> [-0.5477, 0.5477, -1.0954, 1.0954]
    adv = group_advantages(torch.tensor([0.0, 1.0, 2.0, 4.0]), 2, "dr_grpo", eps=0.0, whiten=True)
    std = math.sqrt(5 / 6)
    assert adv.tolist() == pytest.approx([-0.5 / std, 0.5 / std, -1.0 / std, 1.0 / std])


def test_whitening_keeps_flat_groups_at_exactly_zero():
    assert group_advantages(torch.tensor([0.3, 0.3, 0.7, 0.7]), 2, "grpo", whiten=True).tolist() == [0.0] * 4
    # Group [0.1, 0.7] is centred to [-0.3, 0.3] only up to float rounding; re-centring on the batch mean would
    # leak that rounding into the flat group [0.3, 0.3].
    adv = group_advantages(torch.tensor([0.1, 0.7, 0.3, 0.3]), 2, "rloo", whiten=True)
    assert adv[2:].tolist() == [0.0, 0.0]


def test_dr_grpo_with_whitening_is_reinforce_pp_baseline():
    rewards = torch.tensor([0.0, 1.0, 0.5, 3.0, 2.0, 2.0])
    assert torch.equal(group_advantages(rewards, 3, "dr_grpo", whiten=True),
                       group_advantages(rewards, 3, "reinforce_pp_baseline"))


@pytest.mark.parametrize("estimator", ["reinforce_pp", "reinforce_pp_baseline"])
def test_whitening_twice_is_refused(estimator):
    with pytest.raises(ValueError, match="already whitens"):
        group_advantages(torch.tensor([0.0, 1.0]), 2, estimator, whiten=True)


def test_group_advantages_carry_no_gradient():
    rewards = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not group_advantages(rewards, 2, "grpo").requires_grad


@pytest.mark.parametrize(("b", "g", "estimator"), [(6, 4, "grpo"), (4, 1, "rloo"), (4, 2, "gae")])
def test_group_advantages_reject_bad_shapes(b, g, estimator):
    with pytest.raises(ValueError, match=r"group_size|gae"):
        group_advantages(torch.zeros(b), g, estimator)


def test_token_advantages_broadcast_by_default():
    mask = ragged_mask([3, 1, 0], 4)
    adv = token_advantages(torch.tensor([2.0, -1.0, 5.0]), mask)
    assert adv.tolist() == [[2.0, 2.0, 2.0, 0.0], [-1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


def test_token_advantages_discounted_with_token_rewards():
    # mask [1, 1, 1, 0], token rewards [0.1, 0.2, 0.3, 9 (padding)], sequence advantage 1 on the last token, gamma 0.5
    # rewards = [0.1, 0.2, 1.3, 0]: A_2 = 1.3, A_1 = 0.2 + 0.5 x 1.3 = 0.85, A_0 = 0.1 + 0.5 x 0.85 = 0.525
    adv = token_advantages(torch.tensor([1.0]), ragged_mask([3], 4), token_rewards=torch.tensor([[0.1, 0.2, 0.3, 9.0]]),
                           gamma=0.5)
    assert adv[0].tolist() == pytest.approx([0.525, 0.85, 1.3, 0.0])


def test_token_advantages_gamma_one_sums_token_rewards():
    # gamma 1: A_t = sum_{s >= t} rewards_s: rewards [-0.1, -0.2, 1 - 0.3] -> [0.4, 0.5, 0.7]
    adv = token_advantages(torch.tensor([1.0]), ragged_mask([3], 3), token_rewards=torch.tensor([[-0.1, -0.2, -0.3]]))
    assert adv[0].tolist() == pytest.approx([0.4, 0.5, 0.7])


def test_token_advantages_skip_holes_in_the_mask():
    # mask [1, 0, 1], gamma 0.5: the hole is not a step. A_2 = 1, A_1 = 0 (masked), A_0 = 0.5 x 1
    adv = token_advantages(torch.tensor([1.0]), torch.tensor([[1.0, 0.0, 1.0]]), gamma=0.5)
    assert adv[0].tolist() == pytest.approx([0.5, 0.0, 1.0])


def test_gae_tiny_example():
    # r = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 1, lam 0.5; t = 3 is padding with garbage
    # delta_2 = 1 + 0 - 0.7 = 0.3                   A_2 = 0.3
    # delta_1 = 0 + 0.7 - 0.6 = 0.1                 A_1 = 0.1 + 0.5 x 0.3 = 0.25
    # delta_0 = 0 + 0.6 - 0.5 = 0.1                 A_0 = 0.1 + 0.5 x 0.25 = 0.225
    # returns = A + V = [0.725, 0.85, 1.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0, 100.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 50.0]])
    adv, ret = gae(rewards, values, ragged_mask([3], 4), gamma=1.0, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.225, 0.25, 0.3, 0.0])
    assert ret[0].tolist() == pytest.approx([0.725, 0.85, 1.0, 0.0])


def test_gae_lambda_one_is_monte_carlo():
    # lam 1, gamma 0.9: returns are discounted reward sums [0.81, 0.9, 1], advantages = returns - V
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), values, torch.ones(1, 3), gamma=0.9, lam=1.0)
    assert ret[0].tolist() == pytest.approx([0.81, 0.9, 1.0])
    assert adv[0].tolist() == pytest.approx([0.31, 0.3, 0.3])


def test_gae_discounted_with_ragged_rows():
    # gamma 0.9, lam 0.8 (gamma lam = 0.72). Row 0: r = [0, 0, 1], V = [0.5, 0.6, 0.7]
    #   delta_2 = 1 - 0.7 = 0.3                       A_2 = 0.3
    #   delta_1 = 0.9 x 0.7 - 0.6 = 0.03              A_1 = 0.03 + 0.72 x 0.3 = 0.246
    #   delta_0 = 0.9 x 0.6 - 0.5 = 0.04              A_0 = 0.04 + 0.72 x 0.246 = 0.21712
    #   returns = A + V = [0.71712, 0.846, 1.0]
    # Row 1, two tokens: r = [0, 2], V = [1.0, 0.5]; t = 2 is padding with garbage, not bootstrapped from
    #   delta_1 = 2 - 0.5 = 1.5                       A_1 = 1.5
    #   delta_0 = 0.9 x 0.5 - 1.0 = -0.55             A_0 = -0.55 + 0.72 x 1.5 = 0.53
    #   returns = [1.53, 2.0]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [1.0, 0.5, 40.0]])
    adv, ret = gae(rewards, values, ragged_mask([3, 2], 3), gamma=0.9, lam=0.8)
    assert adv.tolist() == [pytest.approx([0.21712, 0.246, 0.3]), pytest.approx([0.53, 1.5, 0.0])]
    assert ret.tolist() == [pytest.approx([0.71712, 0.846, 1.0]), pytest.approx([1.53, 2.0, 0.0])]


def verl_gae(rewards, values, mask, gamma, lam):
    """verl's `compute_gae_advantage_return` (core_algos.py), without its whitening: the seed system's loop."""
    nextvalues, lastgaelam, out = 0, 0, []
    for t in reversed(range(rewards.shape[-1])):
        delta = rewards[:, t] + gamma * nextvalues - values[:, t]
        lastgaelam_ = delta + gamma * lam * lastgaelam
        nextvalues = values[:, t] * mask[:, t] + (1 - mask[:, t]) * nextvalues
        lastgaelam = lastgaelam_ * mask[:, t] + (1 - mask[:, t]) * lastgaelam
        out.append(lastgaelam)
    adv = torch.stack(out[::-1], dim=1)
    return adv * mask, (adv + values) * mask


def test_gae_matches_verl_on_random_ragged_batches():
    torch.manual_seed(0)
    mask = ragged_mask([7, 1, 4, 0, 5], 7)
    mask[2, 1] = 0.0  # a hole (e.g. a masked observation token) is jumped over by both
    rewards, values = torch.randn(5, 7, dtype=torch.float64), torch.randn(5, 7, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, gamma=0.95, lam=0.9)
    want_adv, want_ret = verl_gae(rewards, values, mask.double(), 0.95, 0.9)
    torch.testing.assert_close(adv, want_adv)
    torch.testing.assert_close(ret, want_ret)


def test_whiten_tokens_over_valid_tokens():
    # valid [1, 2, 3]: mean 2, unbiased std 1 -> [-1, 0, 1]; padding (garbage) -> 0
    adv = torch.tensor([[1.0, 2.0, 50.0], [3.0, -7.0, 0.0]])
    out = whiten_tokens(adv, ragged_mask([2, 1], 3), eps=0.0)
    assert out.tolist() == [pytest.approx([-1.0, 0.0, 0.0]), pytest.approx([1.0, 0.0, 0.0])]
    assert whiten_tokens(torch.tensor([[4.0]]), torch.ones(1, 1), eps=1e-6).item() == 0.0
