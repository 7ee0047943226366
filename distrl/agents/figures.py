"""A step's episode figures (`agent/*`), from the `Episode` records and loss masks of its samples."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run_dir imports this module, and `distrl validate` must not import torch
    from distrl.types import Rollouts

CUTS = ("max_turns", "max_tokens", "context", "env_timeout", "env_error")


def episode_metrics(rollouts: Rollouts) -> dict[str, float]:
    """Turns per episode (mean, max), tool calls and failed ones, unparseable calls, seconds waiting on
    environments (mean per episode), the fraction of episodes each budget or failure cut, the fraction of response
    tokens masked (observations), the episodes started again because their environment's host died, and the two
    drift counters: `agent/retokenization_drift`, tokens where a
    trajectory differs from what the engine was given and sampled (0 unless distrl has a bug), and
    `agent/template_drift_frac`, episodes that rendering their messages anew would have tokenized otherwise."""
    episodes = rollouts.episodes
    tokens = sum(len(m) for m in rollouts.loss_mask)
    out = {
        "agent/turns_mean": statistics.fmean(e.turns for e in episodes),
        "agent/turns_max": float(max(e.turns for e in episodes)),
        "agent/tool_calls": float(sum(e.tool_calls for e in episodes)),
        "agent/tool_errors": float(sum(e.tool_errors for e in episodes)),
        "agent/parse_errors": float(sum(e.parse_errors for e in episodes)),
        "agent/env_wait_s": statistics.fmean(e.env_wait_s for e in episodes),
        "agent/cut_frac": statistics.fmean(e.cut is not None for e in episodes),
        "agent/masked_frac": sum(len(m) - sum(m) for m in rollouts.loss_mask) / tokens if tokens else 0.0,
        "agent/retokenization_drift": float(sum(e.drift for e in episodes)),
        "faults/env_restarted_episodes": float(sum(e.restarts > 0 for e in episodes)),
        "agent/template_drift_frac": statistics.fmean(e.template_drift for e in episodes),
    }
    out.update({f"agent/cut/{reason}": float(sum(e.cut == reason for e in episodes)) for reason in CUTS})
    return out
