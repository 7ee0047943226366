"""What producing one batch took, as figures of the step's row: the producer's counters (groups kept and filtered,
rewards that failed, engines replaced, let go and added, prompts sent again) and the batch's staleness."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from distrl.algo.correction import STALENESS_BUCKETS


@dataclass
class BatchStats:
    """What producing one batch took: figures for the step's metrics row."""

    dropped_stale: int = 0  # episodes (of dropped groups)
    scored: int = 0  # episodes whose rewards came back, kept or not
    reward_errors: int = 0  # of them, those whose reward function failed (scored 0 under on_error: zero)
    last_reward_error: str | None = None
    filtered_groups: int = 0
    kept_groups: int = 0
    cap_reached: int = 0
    buffer_depth: int = 0
    rollout_idle: float = 0.0
    rollout_restarts: int = 0  # rollout actors replaced
    rollout_retired: int = 0  # rollout actors let go after a death (above cluster.rollout.min_actors)
    rollout_added: int = 0  # rollout actors started while the run went on (below cluster.rollout.max_actors)
    engines: int | None = None  # rollout actors serving or starting when the batch was handed out (when their
    # number may change: cluster.rollout.min_actors / max_actors)
    redispatched_prompts: int = 0  # prompts whose chunk was lost with its actor and sent again
    carried_tokens: int | None = None  # partial rollouts: tokens of unfinished groups when the batch was handed out
    redispatched_tokens: int = 0  # partial rollouts: tokens sampled before the slice a lost chunk held (kept, and
    # sent again as the prefixes of its samples)

    def metrics(self) -> dict[str, float]:
        seen = self.kept_groups + self.filtered_groups
        elastic = ({"rollout/engines": float(self.engines), "rollout/engines_added": float(self.rollout_added),
                    "faults/rollout_retired": float(self.rollout_retired)} if self.engines is not None else {})
        carried = ({"partial/carried_tokens": float(self.carried_tokens),
                    "partial/redispatched_tokens": float(self.redispatched_tokens)}
                   if self.carried_tokens is not None else {})
        return {**carried, "reward/errors": float(self.reward_errors),
                "samples/dropped_stale": float(self.dropped_stale),
                "faults/rollout_restarts": float(self.rollout_restarts), **elastic,
                "faults/redispatched_prompts": float(self.redispatched_prompts),
                "dynamic_sampling/filtered_groups": float(self.filtered_groups),
                "dynamic_sampling/kept_frac": self.kept_groups / seen if seen else 1.0,
                "dynamic_sampling/cap_reached": float(self.cap_reached),
                "buffer/depth": float(self.buffer_depth),
                "idle/rollout": self.rollout_idle}


def staleness_metrics(versions: list[int], step: int) -> dict[str, float]:
    """Staleness u - v of each sample of `step` (u = step - 1): mean, max and the off-policy fraction (> 0)."""
    lags = [step - 1 - v for v in versions]
    return {"staleness/mean": statistics.fmean(lags), "staleness/max": float(max(lags)),
            "staleness/off_policy_frac": statistics.fmean(lag > 0 for lag in lags)}


def token_age_metrics(token_versions: list[list[int]], loss_mask: list[list[int]], step: int) -> dict[str, float]:
    """The trained tokens of `step` (update from version u = step - 1) by age u - v: the share of each bucket of
    `STALENESS_BUCKETS` (ages 0, 1, 2, 3 and 4+: `tokens/age_<a>_share`), and the versions one sample spans (newest -
    oldest + 1, mean and max over samples with a trained token: more than 1 when its sampling went on across a weight
    push)."""
    ages = [step - 1 - v for versions, mask in zip(token_versions, loss_mask, strict=True)
            for v, m in zip(versions, mask, strict=True) if m]
    spans = [max(t) - min(t) + 1 for t in ([v for v, m in zip(vs, ms, strict=True) if m]
                                           for vs, ms in zip(token_versions, loss_mask, strict=True)) if t]
    if not ages:
        return {}
    shares = {name: sum(low <= a and (high is None or a <= high) for a in ages) / len(ages)
              for name, low, high in STALENESS_BUCKETS}
    return {**{f"tokens/age_{name}_share": share for name, share in shares.items()},
            "tokens/versions_spanned_mean": statistics.fmean(spans), "tokens/versions_spanned_max": float(max(spans))}
