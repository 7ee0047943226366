"""From `Rollouts` to padded `Sequences`, and from rewards to advantages. Pure torch, no Ray.

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
from distrl.types import Rollouts, Sequences


def pad(rollouts: Rollouts, pad_id: int) -> Sequences:
    """Left-pad prompts to P, right-pad responses to T (at least 1)."""
    b = len(rollouts)
    p = max(len(ids) for ids in rollouts.prompt_ids)
    t = max(1, *(len(ids) for ids in rollouts.response_ids))
    input_ids = torch.full((b, p + t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p + t), dtype=torch.long)
    response_mask = torch.zeros((b, t))
    rollout_logprobs = torch.zeros((b, t))
    rows = zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.rollout_logprobs, strict=True)
    for i, (prompt, response, lps) in enumerate(rows):
        input_ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        attention_mask[i, p - len(prompt) : p + len(response)] = 1
        if response:
            input_ids[i, p : p + len(response)] = torch.tensor(response)
            response_mask[i, : len(response)] = 1.0
            rollout_logprobs[i, : len(response)] = torch.tensor(lps)
    return Sequences(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                     rollout_logprobs=rollout_logprobs,
                     policy_version=torch.tensor(rollouts.policy_version, dtype=torch.long))


def advantages(rewards: torch.Tensor, response_mask: torch.Tensor, old_logprobs: torch.Tensor | None,
               ref_logprobs: torch.Tensor | None, group_size: int, algo: AlgorithmConfig, kl: KLConfig,
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """Token advantages `[B, T]` from sequence rewards `[B]` (and, for KL in the reward, the old and reference
    log-probs `[B, T]`); returns them with advantage / KL-penalty metrics."""
    metrics: dict[str, float] = {}
    scores = rewards.to(torch.float32)
    if kl.target == "reward" and kl.coef > 0:
        if ref_logprobs is None or old_logprobs is None:
            raise ValueError("loss.kl.target 'reward' needs the old and reference log-probs before advantages")
        penalty = kl_estimate(old_logprobs, ref_logprobs, kl.estimator) * response_mask
        scores = scores - kl.coef * penalty.sum(-1)
        metrics["kl/in_reward"] = float(penalty.sum() / response_mask.sum().clamp(min=1))
    seq_adv = group_advantages(scores, group_size, algo.advantage, eps=algo.eps, whiten=algo.whitening)
    adv = token_advantages(seq_adv, response_mask, gamma=algo.gamma)
    valid = response_mask.bool()
    metrics.update({"advantage/mean": float(adv[valid].mean()) if valid.any() else 0.0,
                    "advantage/std": float(adv[valid].std()) if valid.sum() > 1 else 0.0})
    return adv, metrics
