"""`one_turn(...)`: `Rollouts` of one-turn samples from the fields tests care about, every token trained and sampled
by its sample's policy version."""

from __future__ import annotations

from distrl.types.rollouts import Episode, Rollouts


def one_turn(prompt_ids: list[list[int]], response_ids: list[list[int]], rollout_logprobs: list[list[float]],
             response_texts: list[str], finish_reasons: list[str], group: list[int],
             policy_version: list[int]) -> Rollouts:
    out = Rollouts.empty()
    for prompt, ids, lps, text, reason, g, version in zip(prompt_ids, response_ids, rollout_logprobs, response_texts,
                                                          finish_reasons, group, policy_version, strict=True):
        out.add(prompt, ids, lps, [1] * len(ids), [version] * len(ids), text, reason, g, Episode(), version)
    return out.validate()
