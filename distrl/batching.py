"""From `Rollouts` to padded `Sequences`, from rewards to advantages, and the covariance losses' tokens (selected
over each whole mini-batch before the batch is split). Pure torch, no Ray.

Advantages follow the configured estimator on the sequence scores, or GAE on token rewards and the critic's
values. With `loss.kl.target: reward` the per-token penalty `coef * kl_t`, kl_t estimated from the old policy's
log-probs against the reference's, is subtracted from the token rewards, whose sum is the score a group estimator
normalises and which GAE takes token by token (verl's `apply_kl_penalty` followed by its estimators). The old
log-probs are the learner's (or vLLM's in bypass mode), never vLLM's alongside the learner's: mixing the engine's
precision into kl_t would add the rollout/trainer mismatch to the penalty.
"""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import torch

from distrl.algo import (
    covariance_selection,
    explained_variance,
    gae,
    group_advantages,
    kl_estimate,
    masked_mean,
    token_advantages,
    whiten_tokens,
)
from distrl.config import AlgorithmConfig, ClipCovConfig, KLConfig, KLCovConfig
from distrl.types.batches import Sequences, mini_batch_bounds
from distrl.types.rollouts import Rollouts


def pad(rollouts: Rollouts, pad_id: int) -> Sequences:
    """Left-pad prompts to P, right-pad responses to T (at least 1); the response mask is the samples' loss mask
    (observation tokens of multi-turn episodes are inputs, not trained on); routes, when the engine gave some, in
    the same columns (`padded_routes`)."""
    b = len(rollouts)
    p = max(len(ids) for ids in rollouts.prompt_ids)
    t = max(1, *(len(ids) for ids in rollouts.response_ids))
    input_ids = torch.full((b, p + t), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((b, p + t), dtype=torch.long)
    response_mask = torch.zeros((b, t))
    rollout_logprobs = torch.zeros((b, t))
    response_versions = torch.zeros((b, t), dtype=torch.long)
    rows = zip(rollouts.prompt_ids, rollouts.response_ids, rollouts.rollout_logprobs, rollouts.loss_mask,
               rollouts.token_versions, strict=True)
    for i, (prompt, response, lps, mask, versions) in enumerate(rows):
        input_ids[i, p - len(prompt) : p] = torch.tensor(prompt)
        attention_mask[i, p - len(prompt) : p + len(response)] = 1
        if response:
            n = len(response)
            input_ids[i, p : p + n] = torch.tensor(response)
            response_mask[i, :n] = torch.tensor(mask, dtype=torch.float32)
            rollout_logprobs[i, :n] = torch.tensor(lps)
            response_versions[i, :n] = torch.tensor(versions)
    routes, routed = padded_routes(rollouts, p, t)
    return Sequences(input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
                     rollout_logprobs=rollout_logprobs,
                     policy_version=torch.tensor(rollouts.policy_version, dtype=torch.long),
                     response_versions=response_versions, routes=routes, routed=routed)


def padded_routes(rollouts: Rollouts, p: int, t: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The samples' routes in the padded columns (`Sequences.routes` `[B, P+T, L, k]`, uint8, or int16 for more
    than 256 experts, and `Sequences.routed` `[B, P+T]`), sample i's n_i routes from its first real column on; (None,
    None) when no sample has routes. A sample without routes (an agent's call the engine gave none) is all
    unrouted: its routers choose their own experts, as they do for each sample's tokens past its n_i."""
    given = [(i, r) for i, r in enumerate(rollouts.routes) if r is not None]
    if not given:
        return None, None
    shapes = {r.shape[1:] for _, r in given}
    if len(shapes) > 1:
        raise ValueError(f"Rollouts.routes: samples of different [layers, k] shapes {sorted(shapes)}")
    wide = any(r.dtype.itemsize > 1 for _, r in given)
    routes = torch.zeros((len(rollouts), p + t, *shapes.pop()), dtype=torch.int16 if wide else torch.uint8)
    routed = torch.zeros((len(rollouts), p + t), dtype=torch.bool)
    for i, r in given:
        first = p - len(rollouts.prompt_ids[i])
        routes[i, first:first + len(r)] = torch.from_numpy(r.astype(np.int16 if wide else np.uint8))
        routed[i, first:first + len(r)] = True
    return routes, routed


def kl_penalty(response_mask: torch.Tensor, old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None,
               kl: KLConfig) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The per-token penalty `coef * kl_t` `[B, T]` (0 on padding) of `loss.kl.target: reward`, with its metric;
    None when the KL is not in the reward."""
    if not (kl.target == "reward" and kl.coef > 0):
        return None, {}
    if ref_logprobs is None or old_logprobs is None:
        raise ValueError("loss.kl.target 'reward' needs the old and reference log-probs before advantages")
    penalty = kl_estimate(old_logprobs, ref_logprobs, kl.estimator) * response_mask
    return kl.coef * penalty, {"kl/in_reward": float(penalty.sum() / response_mask.sum().clamp(min=1))}


def advantages(rewards: torch.Tensor, response_mask: torch.Tensor, old_logprobs: torch.Tensor | None,
               ref_logprobs: torch.Tensor | None, group_size: int, algo: AlgorithmConfig, kl: KLConfig,
               episode: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Token advantages `[B, T]` from sequence rewards `[B]` (and, for KL in the reward, the old and reference
    log-probs `[B, T]`) by a group estimator; returns them with advantage / KL-penalty metrics.

    `episode` `[B]` long (`Rollouts.episode_index`; None: every row its own episode) says which episode each row
    belongs to. The estimator sees each episode once: its score is its reward (every row of an episode holds it)
    minus the KL penalties summed over all its rows, groups are the `group_size` episodes of a prompt, and every row
    of an episode takes the episode's advantage (spread over its tokens by `token_advantages`)."""
    scores = rewards.to(torch.float32)
    penalty, metrics = kl_penalty(response_mask, old_logprobs, ref_logprobs, kl)
    if episode is not None:
        rows = torch.bincount(episode)  # an episode's rows are contiguous: its first is the rows before it
        first = rows.cumsum(0) - rows
        if not torch.equal(scores, scores[first][episode]):
            row = int((scores != scores[first][episode]).nonzero()[0])
            raise ValueError(f"advantages: row {row} has reward {float(scores[row])}, its episode's first row "
                             f"{int(first[episode[row]])} has {float(scores[first[episode[row]]])}: every row of "
                             f"an episode must hold the episode's reward")
        scores = scores[first]
        if penalty is not None:
            scores = scores - torch.zeros(len(rows)).index_add(0, episode, penalty.sum(-1))
    elif penalty is not None:
        scores = scores - penalty.sum(-1)
    seq_adv = group_advantages(scores, group_size, algo.advantage, eps=algo.eps, whiten=algo.whitening)
    if episode is not None:
        seq_adv = seq_adv[episode]
    adv = token_advantages(seq_adv, response_mask, gamma=algo.gamma)
    metrics.update(advantage_metrics(adv, response_mask))
    return adv, metrics


def gae_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, values: torch.Tensor,
                   old_logprobs: torch.Tensor | None, ref_logprobs: torch.Tensor | None, algo: AlgorithmConfig,
                   kl: KLConfig) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Token advantages and returns `[B, T]` by GAE from sequence rewards `[B]` and the critic's values `[B, T]`.

    The token rewards are the sequence's score on its last response token, minus `coef * kl_t` on every token with
    `loss.kl.target: reward` (verl's `apply_kl_penalty`, Ouyang et al. 2022). Each row is its own sequence: every
    row of an episode of several sequences (`Episode.segment`) holds the episode's reward, on its own last token, and
    its values and returns end with it (the critic values each sequence's context for the episode's outcome).
    With `algorithm.whitening` the advantages are whitened over the batch's tokens (verl's `masked_whiten`); the
    returns, the critic's targets, never are. Metrics: advantage mean / std, `critic/explained_variance` of the
    values for the returns, `critic/returns_mean`, and the KL penalty's.
    """
    valid = response_mask.bool()
    t = valid.shape[-1]
    last = torch.where(valid, torch.arange(t), 0).amax(-1, keepdim=True)  # last valid index (0 for an empty row)
    scores = torch.where(valid.any(-1), rewards.to(torch.float32), 0.0).unsqueeze(-1)
    token_rewards = torch.zeros(valid.shape).scatter_add(-1, last, scores)
    penalty, metrics = kl_penalty(response_mask, old_logprobs, ref_logprobs, kl)
    if penalty is not None:
        token_rewards = token_rewards - penalty
    adv, returns = gae(token_rewards, values, response_mask, gamma=algo.gamma, lam=algo.lam)
    if algo.whitening:
        adv = whiten_tokens(adv, response_mask, algo.eps)
    metrics.update(advantage_metrics(adv, response_mask))
    metrics["critic/explained_variance"] = float(explained_variance(values, returns, response_mask))
    metrics["critic/returns_mean"] = float(masked_mean(returns, response_mask))
    return adv, returns, metrics


def advantage_metrics(adv: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    valid = response_mask.bool()
    return {"advantage/mean": float(adv[valid].mean()) if valid.any() else 0.0,
            "advantage/std": float(adv[valid].std()) if valid.sum() > 1 else 0.0}


def select_by_covariance(old_logprobs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
                         policy: ClipCovConfig | KLCovConfig, mini_batches: int, seed: int) -> torch.Tensor:
    """The tokens `[B, T]` bool that Clip-Cov cuts or KL-Cov penalises: selected over each of the batch's
    `mini_batches` mini-batches (the rows of one optimizer step, as `TrainBatch.shard` cuts them), from the whole
    mini-batch's covariance (`distrl.algo.covariance_selection`), before the batch is split over learners and
    micro-batches. Clip-Cov's draws come from a generator seeded with `seed` (the driver's: run seed and step)."""
    generator = torch.Generator().manual_seed(seed)
    selected = torch.zeros(response_mask.shape, dtype=torch.bool)
    for a, b in pairwise(mini_batch_bounds(response_mask.shape[0], mini_batches)):
        selected[a:b] = covariance_selection(old_logprobs[a:b], advantages[a:b], response_mask[a:b], policy,
                                             generator)
    return selected
