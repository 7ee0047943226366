"""Rollouts -> Sequences -> TrainBatch: padding layout, per-sample versions, advantages on response tokens only, and
the stage types' row operations."""

import dataclasses

import numpy as np
import pytest
import torch

from distrl.algo import covariance_selection
from distrl.batching import advantages, gae_advantages, pad, select_by_covariance
from distrl.config import AlgorithmConfig, ClipCovConfig, KLCovConfig, KLInLoss, KLInReward
from distrl.micro_batches import balanced_parts
from distrl.types.batches import Sequences, TrainBatch, in_row_order
from distrl.types.rollouts import Episode, Rollouts, ScoredRollouts
from tests.one_turn import one_turn

PAD = 0


def rollouts(versions=(3, 3, 2, 2)) -> Rollouts:
    # Two prompts (lengths 2 and 3), two samples each; response lengths 1, 3, 0, 2.
    return one_turn(
        prompt_ids=[[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]],
        response_ids=[[11], [12, 13, 14], [], [15, 16]],
        rollout_logprobs=[[-0.1], [-0.2, -0.3, -0.4], [], [-0.5, -0.6]],
        response_texts=["a", "bcd", "", "ef"], finish_reasons=["stop", "length", "stop", "stop"],
        group=[0, 0, 1, 1], policy_version=list(versions),
    )


def train_batch(seqs: Sequences, adv: torch.Tensor | None = None) -> TrainBatch:
    zeros = torch.zeros_like(seqs.rollout_logprobs)
    return TrainBatch(seqs, old_logprobs=seqs.rollout_logprobs, advantages=zeros if adv is None else adv,
                      ref_logprobs=None)


def test_layout_left_pads_prompts_and_right_pads_responses():
    s = pad(rollouts(), PAD)
    assert s.prompt_len == 3 and s.response_len == 3
    assert s.input_ids[0].tolist() == [PAD, 5, 6, 11, PAD, PAD]
    assert s.attention_mask[0].tolist() == [0, 1, 1, 1, 0, 0]
    assert s.input_ids[1].tolist() == [PAD, 5, 6, 12, 13, 14]
    assert s.attention_mask[2].tolist() == [1, 1, 1, 0, 0, 0]  # empty response: prompt only
    assert s.response_mask.tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0]]
    assert s.rollout_logprobs[3].tolist() == pytest.approx([-0.5, -0.6, 0.0])
    assert s.policy_version.tolist() == [3, 3, 2, 2]  # each sample keeps the version that generated it


def test_grpo_advantages_broadcast_over_response_tokens():
    s = pad(rollouts(), PAD)
    # Group 0 rewards (1, 0): mean 0.5, unbiased std 0.7071 -> A = +-0.7071; group 1 ties (2, 2) -> 0.
    adv, _ = advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), s.response_mask, s.rollout_logprobs, None, 2,
                        AlgorithmConfig(advantage="grpo"), KLInLoss())
    a = 0.5 / (2**0.5 / 2 + 1e-6)
    assert adv[0].tolist() == pytest.approx([a, 0, 0], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([-a, -a, -a], abs=1e-5)
    assert adv[2:].abs().sum() == 0


def test_kl_in_reward_is_subtracted_from_the_score_before_the_estimator():
    s = pad(rollouts(), PAD)
    # KL of the policy that sampled (the learner's old log-probs, not vLLM's): x = old - ref = 1 on every response
    # token, while rollout - ref would be 1.5.
    old = s.rollout_logprobs - 0.5 * s.response_mask
    ref = s.rollout_logprobs - 1.5 * s.response_mask
    adv, metrics = advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), s.response_mask, old, ref, 2,
                              AlgorithmConfig(advantage="dr_grpo"), KLInReward(coef=0.1, estimator="k1"))
    # Scores r - 0.1 * sum_t kl_t, response lengths 1, 3, 0, 2: [0.9, -0.3, 2.0, 1.8].
    # Dr. GRPO subtracts group means (0.3 and 1.9): [0.6, -0.6, 0.1, -0.1], broadcast over response tokens.
    assert adv[0].tolist() == pytest.approx([0.6, 0, 0], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([-0.6] * 3, abs=1e-6)
    assert adv[3].tolist() == pytest.approx([-0.1, -0.1, 0], abs=1e-6)
    assert metrics["kl/in_reward"] == pytest.approx(1.0)


def segmented(segments: list[int], group: list[int]) -> Rollouts:
    """Rows of response lengths 1, 3, 2, 1, 2 (every token trained), episodes cut by `segments`."""
    lengths = [1, 3, 2, 1, 2]
    r = one_turn(prompt_ids=[[5, 6]] * 5, response_ids=[[11] * k for k in lengths],
                 rollout_logprobs=[[-0.1] * k for k in lengths], response_texts=["x"] * 5,
                 finish_reasons=["stop"] * 5, group=group, policy_version=[0] * 5)
    return dataclasses.replace(r, episodes=[Episode(segment=k) for k in segments]).validate()


def test_an_episode_of_several_sequences_is_scored_once_and_every_row_takes_its_advantage():
    r = segmented([0, 1, 0, 0, 0], group=[0, 0, 0, 1, 1])  # episodes A = rows 0-1, B = 2 | C = 3, D = 4
    assert r.episode_index() == [0, 0, 1, 2, 3] and r.episode_bounds() == [(0, 2), (2, 3), (3, 4), (4, 5)]
    s = pad(r, PAD)
    old = s.rollout_logprobs - 0.5 * s.response_mask
    ref = s.rollout_logprobs - 1.5 * s.response_mask  # k1 = 1 on every token
    adv, _ = advantages(torch.tensor([1.0, 1.0, 0.0, 3.0, 1.0]), s.response_mask, old, ref, 2,
                        AlgorithmConfig(advantage="dr_grpo"), KLInReward(coef=0.1, estimator="k1"),
                        episode=torch.tensor(r.episode_index()))
    # Episode scores: A 1 - 0.1 (1 + 3) = 0.6 (both its rows' penalties), B 0 - 0.2 = -0.2, C 3 - 0.1 = 2.9,
    # D 1 - 0.2 = 0.8. Group means 0.2 and 1.85: A 0.4, B -0.4, C 1.05, D -1.05; each row takes its episode's.
    assert adv[:, 0].tolist() == pytest.approx([0.4, 0.4, -0.4, 1.05, -1.05], abs=1e-6)
    assert adv[1].tolist() == pytest.approx([0.4] * 3, abs=1e-6) and adv[2, 2] == 0  # padding
    # GRPO over episodes (1, 0) and (3, 1): +-0.7071 each, A's two rows alike.
    adv, _ = advantages(torch.tensor([1.0, 1.0, 0.0, 3.0, 1.0]), s.response_mask, None, None, 2,
                        AlgorithmConfig(advantage="grpo"), KLInLoss(), episode=torch.tensor(r.episode_index()))
    a = 0.5 / (2**0.5 / 2 + 1e-6)
    assert adv[:, 0].tolist() == pytest.approx([a, a, -a, a, -a], abs=1e-5)


def test_rows_of_one_episode_must_hold_one_reward():
    r = segmented([0, 1, 0, 0, 0], group=[0, 0, 0, 1, 1])
    s = pad(r, PAD)
    with pytest.raises(ValueError, match=r"row 1 has reward 0\.5, its episode's first row 0 has 1\.0"):
        advantages(torch.tensor([1.0, 0.5, 0.0, 3.0, 1.0]), s.response_mask, None, None, 2,
                   AlgorithmConfig(advantage="grpo"), KLInLoss(), episode=torch.tensor(r.episode_index()))
    with pytest.raises(ValueError, match=r"samples 0\.\.1 has rewards"):
        ScoredRollouts(r, [1.0, 0.5, 0.0, 3.0, 1.0]).validate()
    assert ScoredRollouts(r, [1.0, 1.0, 0.0, 3.0, 1.0]).validate().episode_rewards() == [1.0, 0.0, 3.0, 1.0]


@pytest.mark.parametrize("segments,group", [([1, 0, 0, 0, 0], [0] * 5), ([0, 2, 0, 0, 0], [0] * 5),
                                            ([0, 1, 1, 0, 0], [0] * 5), ([0, 0, 1, 0, 0], [0, 0, 1, 1, 1])])
def test_a_later_segment_follows_its_episode_in_its_group(segments, group):
    with pytest.raises(ValueError, match="does not follow its segment"):
        segmented(segments, group)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp"])
def test_one_sequence_per_episode_gives_the_same_bits_as_no_episode_index(estimator):
    s = pad(rollouts(), PAD)
    old = s.rollout_logprobs - 0.3 * s.response_mask
    ref = s.rollout_logprobs - 1.1 * s.response_mask
    args = (torch.tensor([1.0, 0.25, 2.0, -0.5]), s.response_mask, old, ref, 2,
            AlgorithmConfig(advantage=estimator), KLInReward(coef=0.07, estimator="k3"))
    plain, _ = advantages(*args)
    indexed, _ = advantages(*args, episode=torch.arange(4))
    assert torch.equal(plain, indexed)


def test_kl_in_reward_needs_reference_logprobs():
    s = pad(rollouts(), PAD)
    with pytest.raises(ValueError, match="reference log-probs"):
        advantages(torch.zeros(4), s.response_mask, s.rollout_logprobs, None, 2, AlgorithmConfig(),
                   KLInReward(coef=0.1))


def test_gae_takes_the_score_on_the_last_token_and_the_kl_on_every_token():
    s = pad(rollouts(), PAD)  # response lengths 1, 3, 0, 2
    old = s.rollout_logprobs - 0.5 * s.response_mask
    ref = s.rollout_logprobs - 1.5 * s.response_mask  # k1 = old - ref = 1: penalty 0.1 on every response token
    values = torch.where(s.response_mask.bool(), 0.5, 9.0)  # garbage on padding
    # gamma = lam = 1: returns are the token rewards' sums to go, advantages returns - V.
    # row 0: rewards [1 - 0.1] -> R [0.9], A [0.4]
    # row 1: rewards [-0.1, -0.1, 0 - 0.1] -> R [-0.3, -0.2, -0.1], A [-0.8, -0.7, -0.6]
    # row 2: empty -> 0;  row 3: rewards [-0.1, 2 - 0.1] -> R [1.8, 1.9], A [1.3, 1.4]
    adv, ret, metrics = gae_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), s.response_mask, values, old, ref,
                                       AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0),
                                       KLInReward(coef=0.1, estimator="k1"))
    assert ret.tolist() == [pytest.approx(r, abs=1e-6) for r in ([0.9, 0, 0], [-0.3, -0.2, -0.1], [0, 0, 0],
                                                                  [1.8, 1.9, 0])]
    assert adv.tolist() == [pytest.approx(a, abs=1e-6) for a in ([0.4, 0, 0], [-0.8, -0.7, -0.6], [0, 0, 0],
                                                                  [1.3, 1.4, 0])]
    # Constant values explain none of the returns' variance; returns' mean over the 6 tokens = 4.0 / 6.
    assert metrics["critic/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert metrics["critic/returns_mean"] == pytest.approx(4.0 / 6)
    assert metrics["kl/in_reward"] == pytest.approx(1.0)


def test_gae_whitening_whitens_the_advantages_not_the_returns():
    s = pad(rollouts(), PAD)
    values = torch.where(s.response_mask.bool(), 0.5, 0.0)
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0, whitening=True)
    adv, ret, _ = gae_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), s.response_mask, values, None, None, algo,
                                 KLInLoss())
    valid = s.response_mask.bool()
    assert adv[valid].mean().item() == pytest.approx(0.0, abs=1e-6)
    assert adv[valid].std().item() == pytest.approx(1.0, abs=1e-4)
    assert ret[0, 0].item() == pytest.approx(1.0) and ret[3].tolist() == pytest.approx([2.0, 2.0, 0.0])


def test_shard_gives_each_learner_its_part_of_every_mini_batch():
    s = pad(Rollouts.concat([rollouts(), rollouts()]), PAD)  # rows 0..7
    b = train_batch(s, torch.arange(8.0)[:, None].expand(8, s.response_len).clone())  # row index as a tag
    shards = b.shard(2, mini_batches=2)
    # mini-batches [0..3] and [4..7], real tokens 3 5 3 5 in each; dealt longest first to the learner with the
    # fewest tokens (the first on ties): rows 1, 3 (5 tokens) to learners 0, 1, then rows 0, 2 (3) to 0, 1:
    # learner 0 takes [0, 1] of each, learner 1 [2, 3] of each (8 tokens each)
    assert [sh.advantages[:, 0].tolist() for sh in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert [sh.sequences.policy_version.tolist() for sh in shards] == [[3, 3, 3, 3], [2, 2, 2, 2]]
    # Rows that divide evenly: each learner's mini-batches are its consecutive chunks of 4 / 2 rows, as unlabelled.
    for sh in shards:
        assert [m.advantages[:, 0].tolist() for m in sh.mini_batches(2)] == \
               [m.advantages[:, 0].tolist() for m in sh.chunks(2)]
    with pytest.raises(ValueError, match="3 mini-batches of at least one row for each of 3 learners"):
        b.shard(3, mini_batches=3)


def test_shard_of_an_uneven_batch_keeps_the_mini_batch_count_and_splits_each_near_equally():
    s = pad(Rollouts.concat([rollouts(), rollouts(), rollouts()]), PAD)
    b = train_batch(s, torch.arange(12.0)[:, None].expand(12, s.response_len).clone()).select(slice(0, 9))
    shards = b.shard(2, mini_batches=2)
    # 9 rows -> mini-batches [0..3] and [4..8] (bounds round(0), round(4.5) = 4, 9), real tokens 3 5 3 5 | 3 5 3 5
    # 3; the first splits 2 + 2 rows ([0, 1] + [2, 3], as above), the second 2 + 3 (as the contiguous bounds 4,
    # round(6.5) = 6, 9 would): rows 5, 7 (5 tokens) to learners 0, 1, row 4 to learner 0 (5 = 5, the first),
    # which is then full, rows 6 and 8 to learner 1: [4, 5] + [6, 7, 8].
    assert [sh.advantages[:, 0].tolist() for sh in shards] == [[0, 1, 4, 5], [2, 3, 6, 7, 8]]
    assert [sh.mini_batch.tolist() for sh in shards] == [[0, 0, 1, 1], [0, 0, 1, 1, 1]]
    # Every learner takes 2 optimizer steps, on its part of the same mini-batch, whatever the local size says.
    assert [[m.advantages[:, 0].tolist() for m in sh.mini_batches(2)] for sh in shards] == \
           [[[0, 1], [4, 5]], [[2, 3], [6, 7, 8]]]
    # One learner on the whole batch: the same 2 mini-batches.
    (whole,) = b.shard(1, mini_batches=2)
    assert [m.advantages[:, 0].tolist() for m in whole.mini_batches(4)] == [[0, 1, 2, 3], [4, 5, 6, 7, 8]]


def lengths_batch(real_tokens: list[int]) -> TrainBatch:
    """One row per entry, a 1-token prompt and real_tokens - 1 response tokens, its row index as its advantage."""
    n = len(real_tokens)
    s = pad(one_turn(prompt_ids=[[5]] * n, response_ids=[[11] * (k - 1) for k in real_tokens],
                     rollout_logprobs=[[-0.1] * (k - 1) for k in real_tokens], response_texts=[""] * n,
                     finish_reasons=["stop"] * n, group=list(range(n)), policy_version=[0] * n), PAD)
    return train_batch(s, torch.arange(float(n))[:, None].expand(n, s.response_len).clone())


def test_shard_deals_each_mini_batch_to_the_learners_by_tokens_longest_first():
    b = lengths_batch([10, 9, 2, 8, 1, 1])
    # One mini-batch, two learners of 3 rows. Longest first: row 0 (10) to learner 0, row 1 (9) to learner 1 (0 <
    # 10 tokens), row 3 (8) to learner 1 (9 < 10: 17), row 2 (2) to learner 0 (10 < 17: 12), row 4 (1) to learner 0
    # (12 < 17: 13, now full), row 5 (1) to learner 1 (18). Contiguous blocks would give 21 and 10 tokens.
    assert [rows.tolist() for rows in b.shard_rows(2, 1)] == [[0, 2, 4], [1, 3, 5]]
    shards = b.shard(2, 1)
    assert [sh.advantages[:, 0].tolist() for sh in shards] == [[0, 2, 4], [1, 3, 5]]
    assert [int(sh.sequences.attention_mask.sum()) for sh in shards] == [13, 18]
    # Two mini-batches [0, 1, 2] and [3, 4, 5], each of 2 + 1 rows (bounds 0, round(1.5) = 2, 3): in the first,
    # row 0 (10) to learner 0, row 1 (9) to learner 1, which is then full, row 2 to learner 0; in the second, row 3
    # (8) to learner 0, row 4 (1) to learner 1, row 5 to learner 0.
    shards = b.shard(2, 2)
    assert [sh.advantages[:, 0].tolist() for sh in shards] == [[0, 2, 3, 5], [1, 4]]
    assert [sh.mini_batch.tolist() for sh in shards] == [[0, 0, 1, 1], [0, 1]]
    # Per-row results of the shards (here each row's tag) go back in the batch's row order.
    rows = b.shard_rows(2, 2)
    back = in_row_order([sh.advantages for sh in shards], rows)
    assert torch.equal(back, b.advantages)
    # test_learner's batch (real tokens 8 8 10 10 8 8 8 8), whose two-learner shards the learner tests train on:
    # rows 2, 3 (10) to learners 0, 1, then the 8s alternate from learner 0 (10 = 10, the first): 34 tokens each.
    from test_learner import batch

    assert [r.tolist() for r in batch().shard_rows(2, 1)] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_balanced_parts_keep_the_part_sizes():
    assert balanced_parts([5, 4, 3, 3, 3], [2, 3]) == [[0, 3], [1, 2, 4]]  # 5 -> 0, 4 -> 1, 3 -> 1 (4 < 5), 3 -> 0
    # (5 < 7: full at 8), 3 -> 1 (10)
    assert balanced_parts([], [0, 0]) == [[], []]
    with pytest.raises(ValueError, match="cannot hold exactly 3 rows"):
        balanced_parts([1, 2, 3], [1, 1])


def test_mini_batch_labels_must_be_in_row_order_and_complete():
    b = train_batch(pad(rollouts(), PAD))
    with pytest.raises(ValueError, match="not in row order"):
        dataclasses.replace(b, mini_batch=torch.tensor([0, 1, 0, 1]))
    with pytest.raises(ValueError, match="no row of mini-batch 1"):
        dataclasses.replace(b, mini_batch=torch.tensor([0, 0, 2, 2])).mini_batches(2)


def test_split_and_concat_round_trip():
    b = train_batch(pad(rollouts(), PAD))
    parts = b.split(3)
    assert [p.batch_size for p in parts] == [1, 2, 1]
    again = TrainBatch.concat(parts)
    assert torch.equal(again.sequences.input_ids, b.sequences.input_ids)
    assert torch.equal(again.response_mask, b.response_mask) and again.ref_logprobs is None
    with pytest.raises(ValueError, match="non-empty shards"):
        b.split(5)


def test_stage_types_are_complete_and_immutable():
    s = pad(rollouts(), PAD)
    with pytest.raises(ValueError, match=r"TrainBatch.advantages is \(4, 2\), expected \(4, 3\)"):
        TrainBatch(s, old_logprobs=s.rollout_logprobs, advantages=torch.zeros(4, 2), ref_logprobs=None)
    with pytest.raises(ValueError, match=r"Sequences.policy_version is \(3,\), expected \(4,\)"):
        dataclasses.replace(s, policy_version=torch.zeros(3, dtype=torch.long))
    with pytest.raises(dataclasses.FrozenInstanceError):
        train_batch(s).advantages = torch.zeros(4, 3)  # type: ignore[misc]


def test_concat_joins_parts_of_different_versions():
    joined = Rollouts.concat([rollouts((1, 1, 1, 1)), rollouts((2, 2, 2, 2))])
    assert joined.policy_version == [1] * 4 + [2] * 4 and len(joined) == 8


def test_scored_rollouts_split_into_groups_by_ticket():
    r = Rollouts.concat([rollouts(), dataclasses.replace(rollouts(), group=[7, 7, 9, 9])])
    groups = ScoredRollouts(r, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]).validate().groups()
    assert [g.rollouts.group for g in groups] == [[0, 0], [1, 1], [7, 7], [9, 9]]
    assert [g.rewards for g in groups] == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]]
    assert ScoredRollouts.concat(groups).rewards == [float(i) for i in range(1, 9)]


def test_gae_takes_each_sequence_of_an_episode_as_its_own_with_the_episodes_reward_on_its_last_token():
    r = segmented([0, 1, 0, 0, 0], group=[0, 0, 0, 1, 1])  # episode A = rows 0 (1 token) and 1 (3 tokens)
    s = pad(r, PAD)
    values = torch.where(s.response_mask.bool(), 0.25, 0.0)
    algo = AlgorithmConfig(advantage="gae", gamma=1.0, lam=1.0)
    adv, ret, _ = gae_advantages(torch.tensor([1.0, 1.0, 0.0, 3.0, 1.0]), s.response_mask, values, None, None, algo,
                                 KLInLoss())
    # gamma = lam = 1: A_t = (reward on the sequence's last token) - V_t = 1 - 0.25 on every token of both rows of
    # A, and the returns are that reward; nothing flows from row 1 back into row 0.
    assert adv[0].tolist() == [0.75, 0, 0] and adv[1].tolist() == [0.75] * 3
    assert ret[0].tolist() == [1.0, 0, 0] and ret[1].tolist() == [1.0] * 3


def test_the_covariance_selection_is_each_mini_batch_s_own_and_travels_with_the_rows():
    # 9 rows in 2 mini-batches (rows 0-3 and 4-8, as TrainBatch.shard cuts them): each mini-batch's tokens are
    # selected over its own rows, whatever the other's, and the selection is sharded with its rows.
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(5) < torch.randint(1, 6, (9, 1), generator=g)).float()
    old = -torch.rand(9, 5, generator=g) * 3 * mask
    adv = torch.randn(9, 1, generator=g).expand(9, 5) * mask
    policy = KLCovConfig(kl_cov_ratio=0.2)
    selected = select_by_covariance(old, adv, mask, policy, mini_batches=2, seed=0)
    for rows in (slice(0, 4), slice(4, 9)):
        alone = covariance_selection(old[rows], adv[rows], mask[rows], policy, torch.Generator())
        assert torch.equal(selected[rows], alone) and alone.any()
    # the whole batch as one mini-batch selects differently (its own means, its own top fraction)
    assert not torch.equal(select_by_covariance(old, adv, mask, policy, mini_batches=1, seed=0), selected)
    # Clip-Cov's draws are the seed's: the same seed, the same tokens
    clip = ClipCovConfig(clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0)
    draws = [select_by_covariance(old, adv, mask, clip, mini_batches=2, seed=s) for s in (3, 3, 4)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])
    seqs = dataclasses.replace(pad(rollouts(), PAD), response_mask=torch.ones(4, 3))
    batch = dataclasses.replace(train_batch(seqs), cov_selected=torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1],
                                                                             [1, 1, 0]], dtype=torch.bool))
    rows = batch.shard_rows(2, 1)
    for shard, index in zip(batch.shard(2, 1, rows), rows, strict=True):
        assert torch.equal(shard.cov_selected, batch.cov_selected[index])
    assert torch.equal(TrainBatch.concat(batch.split(2)).cov_selected, batch.cov_selected)


def test_routes_are_padded_into_the_columns_of_their_tokens():
    r = rollouts()
    # Sample 0: prompt 5 6, response 11: the engine routed 5 and 6 (not the last token), 2 layers of top-1 each.
    # Sample 1 has none (an agent's call without routes); samples 2 and 3 are routed by 300 experts (uint16).
    routes = [np.array([[[1], [2]], [[3], [4]]], dtype=np.uint8), None,
              np.array([[[299], [0]], [[7], [8]]], dtype=np.uint16), np.zeros((4, 2, 1), dtype=np.uint16)]
    s = pad(dataclasses.replace(r, routes=routes).validate(), PAD)
    assert s.routes is not None and s.routed is not None
    assert s.routes.shape == (4, 6, 2, 1) and s.routes.dtype == torch.int16  # one sample of > 256 experts: 16 bits
    # Columns: prompt left-padded to P = 3 (sample 0's 5 6 in columns 1, 2), responses from column 3.
    assert s.routes[0, :, :, 0].tolist() == [[0, 0], [1, 2], [3, 4], [0, 0], [0, 0], [0, 0]]
    assert s.routed.tolist() == [[False, True, True, False, False, False], [False] * 6,
                                 [True, True, False, False, False, False], [True, True, True, True, False, False]]
    assert s.routes[2, 0, 0, 0] == 299
    assert pad(r, PAD).routes is None  # no routes: none in the batch (replay off)
    with pytest.raises(ValueError, match="routes of shape"):
        dataclasses.replace(r, routes=[np.zeros((4, 2, 1), dtype=np.uint8), None, None, None]).validate()
    both = Sequences.concat([s, s])
    assert both.routes is not None and both.routes.shape == (8, 6, 2, 1)
    with pytest.raises(ValueError, match="routes are set on some parts"):
        Sequences.concat([s, pad(r, PAD)])
