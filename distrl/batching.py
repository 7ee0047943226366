"""From `Rollouts` + rewards to a padded `TrainBatch` with advantages. Pure torch, no Ray.

Advantages follow the configured estimator on the sequence scores. With `loss.kl.target: reward` the per-token
penalty `coef * kl_t`, kl_t estimated from the old policy's log-probs against the reference's, is subtracted from
the token rewards, whose sum is the score the estimator normalises (verl's `apply_kl_penalty` followed by its
outcome-reward estimators). The old log-probs are the learner's (or vLLM's in bypass mode), never vLLM's alongside
the learner's: mixing the engine's precision into kl_t would add the rollout/trainer mismatch to the penalty.
"""

from __future__ import annotations

import torch

from distrl.algo import group_advantages, kl_estimate, token_advantages
from distrl.config import AlgorithmConfig, KLConfig
from distrl.types import Rollouts, TrainBatch


def to_train_batch(rollouts: Rollouts, pad_id: int) -> TrainBatch:
    """Left-pad prompts to P, right-pad responses to T; advantages start at zero."""
    b = len(rollouts)
    p = max(len(ids) for ids in rollouts.prompt_ids)
    t = max(1, *map(len, rollouts.response_ids))
    input_ids = torch.full((b, p + t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p + t), dtype=torch.long)
    response_mask = torch.zeros((b, t))
    rollout_logprobs = torch.zeros((b, t))
    for i, (prompt, response, lps) in enumerate(zip(rollouts.prompt_ids, rollouts.response_ids,
                                                    rollouts.rollout_logprobs, strict=True)):
        input_ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        attention_mask[i, p - len(prompt) : p + len(response)] = 1
        if response:
            input_ids[i, p : p + len(response)] = torch.tensor(response)
            response_mask[i, : len(response)] = 1.0
            rollout_logprobs[i, : len(response)] = torch.tensor(lps)
    return TrainBatch(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                      advantages=torch.zeros((b, t)), rollout_logprobs=rollout_logprobs,
                      policy_version=rollouts.policy_version).validate()


def assign_advantages(batch: TrainBatch, rewards: torch.Tensor, group_size: int, algo: AlgorithmConfig,
                      kl: KLConfig) -> dict[str, float]:
    """Fill `batch.advantages` `[B, T]` from sequence rewards `[B]`; returns advantage / KL-penalty metrics."""
    metrics: dict[str, float] = {}
    scores = rewards.to(torch.float32)
    if kl.target == "reward" and kl.coef > 0:
        if batch.ref_logprobs is None or batch.old_logprobs is None:
            raise ValueError("loss.kl.target 'reward' needs the old log-probs and the reference log-probs on the "
                             "batch before advantages")
        penalty = kl_estimate(batch.old_logprobs, batch.ref_logprobs, kl.estimator) * batch.response_mask
        scores = scores - kl.coef * penalty.sum(-1)
        metrics["kl/in_reward"] = float(penalty.sum() / batch.response_mask.sum().clamp(min=1))
    seq_adv = group_advantages(scores, group_size, algo.advantage, eps=algo.eps, whiten=algo.whitening)
    batch.advantages = token_advantages(seq_adv, batch.response_mask, gamma=algo.gamma)
    valid = batch.response_mask.bool()
    metrics.update({"advantage/mean": float(batch.advantages[valid].mean()) if valid.any() else 0.0,
                    "advantage/std": float(batch.advantages[valid].std()) if valid.sum() > 1 else 0.0})
    return metrics
