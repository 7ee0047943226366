"""Rollouts -> TrainBatch: padding layout, masks, and advantages placed on response tokens only."""

import pytest
import torch

from distrl.batching import assign_advantages, to_train_batch
from distrl.config import AlgorithmConfig, KLConfig
from distrl.types import Rollouts, TrainBatch

PAD = 0


def rollouts() -> Rollouts:
    # Two prompts (lengths 2 and 3), two samples each; response lengths 1, 3, 0, 2.
    return Rollouts(
        prompt_ids=[[5, 6], [5, 6], [7, 8, 9], [7, 8, 9]],
        response_ids=[[11], [12, 13, 14], [], [15, 16]],
        rollout_logprobs=[[-0.1], [-0.2, -0.3, -0.4], [], [-0.5, -0.6]],
        response_texts=["a", "bcd", "", "ef"], finish_reasons=["stop", "length", "stop", "stop"],
        group=[0, 0, 1, 1], policy_version=3,
    ).validate()


def test_layout_left_pads_prompts_and_right_pads_responses():
    b = to_train_batch(rollouts(), PAD)
    assert b.prompt_len == 3 and b.response_len == 3 and b.policy_version == 3
    assert b.input_ids[0].tolist() == [PAD, 5, 6, 11, PAD, PAD]
    assert b.attention_mask[0].tolist() == [0, 1, 1, 1, 0, 0]
    assert b.input_ids[1].tolist() == [PAD, 5, 6, 12, 13, 14]
    assert b.attention_mask[2].tolist() == [1, 1, 1, 0, 0, 0]  # empty response: prompt only
    assert b.response_mask.tolist() == [[1, 0, 0], [1, 1, 1], [0, 0, 0], [1, 1, 0]]
    assert b.rollout_logprobs[3].tolist() == pytest.approx([-0.5, -0.6, 0.0])


def test_grpo_advantages_broadcast_over_response_tokens():
    b = to_train_batch(rollouts(), PAD)
    # Group 0 rewards (1, 0): mean 0.5, unbiased std 0.7071 -> A = +-0.7071; group 1 ties (2, 2) -> 0.
    assign_advantages(b, torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, AlgorithmConfig(advantage="grpo"), KLConfig())
    a = 0.5 / (2**0.5 / 2 + 1e-6)
    assert b.advantages[0].tolist() == pytest.approx([a, 0, 0], abs=1e-5)
    assert b.advantages[1].tolist() == pytest.approx([-a, -a, -a], abs=1e-5)
    assert b.advantages[2:].abs().sum() == 0


def test_kl_in_reward_is_subtracted_from_the_score_before_the_estimator():
    b = to_train_batch(rollouts(), PAD)
    # KL of the policy that sampled (the learner's old log-probs, not vLLM's): x = old - ref = 1 on every response
    # token, while rollout - ref would be 1.5.
    b.old_logprobs = b.rollout_logprobs - 0.5 * b.response_mask
    b.ref_logprobs = b.rollout_logprobs - 1.5 * b.response_mask
    metrics = assign_advantages(b, torch.tensor([1.0, 0.0, 2.0, 2.0]), 2, AlgorithmConfig(advantage="dr_grpo"),
                                KLConfig(coef=0.1, estimator="k1", target="reward"))
    # Scores r - 0.1 * sum_t kl_t, response lengths 1, 3, 0, 2: [0.9, -0.3, 2.0, 1.8].
    # Dr. GRPO subtracts group means (0.3 and 1.9): [0.6, -0.6, 0.1, -0.1], broadcast over response tokens.
    assert b.advantages[0].tolist() == pytest.approx([0.6, 0, 0], abs=1e-6)
    assert b.advantages[1].tolist() == pytest.approx([-0.6] * 3, abs=1e-6)
    assert b.advantages[3].tolist() == pytest.approx([-0.1, -0.1, 0], abs=1e-6)
    assert metrics["kl/in_reward"] == pytest.approx(1.0)


def test_kl_in_reward_needs_old_and_reference_logprobs():
    b = to_train_batch(rollouts(), PAD)
    b.ref_logprobs = b.rollout_logprobs
    with pytest.raises(ValueError, match="old log-probs"):
        assign_advantages(b, torch.zeros(4), 2, AlgorithmConfig(), KLConfig(coef=0.1, target="reward"))


def test_shard_gives_each_learner_its_part_of_every_mini_batch():
    b = to_train_batch(Rollouts.concat([rollouts(), rollouts()]), PAD)  # rows 0..7
    b.advantages = torch.arange(8.0)[:, None].expand(8, b.response_len).clone()  # row index as a tag
    shards = b.shard(2, mini_batch_size=4)
    # mini-batches [0..3] and [4..7]; learner 0 takes [0, 1] of each, learner 1 takes [2, 3] of each
    assert [s.advantages[:, 0].tolist() for s in shards] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    with pytest.raises(ValueError, match="mini-batches of 3"):
        b.shard(2, mini_batch_size=3)


def test_split_and_concat_round_trip():
    b = to_train_batch(rollouts(), PAD)
    parts = b.split(3)
    assert [p.batch_size for p in parts] == [1, 2, 1]
    again = TrainBatch.concat(parts)
    assert torch.equal(again.input_ids, b.input_ids) and torch.equal(again.response_mask, b.response_mask)
    with pytest.raises(ValueError, match="non-empty shards"):
        b.split(5)


def test_concat_refuses_mixed_versions():
    r = rollouts()
    other = Rollouts(**{**r.__dict__, "policy_version": 4})
    with pytest.raises(ValueError, match="different policy versions"):
        Rollouts.concat([r, other])
