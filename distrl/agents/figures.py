"""A step's episode figures (`agent/*`), from the `Episode` records and loss masks of its samples."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # run_dir imports this module, and `distrl validate` must not import torch
    from distrl.types.rollouts import Rollouts

CUTS = ("max_turns", "max_tokens", "context", "env_timeout", "env_error")


def episode_metrics(rollouts: Rollouts) -> dict[str, float]:
    """Turns per episode (mean, max), tool calls and failed ones, unparseable calls, seconds waiting on
    environments (mean per episode), the fraction of episodes each budget or failure cut, the fraction of response
    tokens masked (observations), the episodes started again because their environment's host died, and the two
    drift counters: `agent/retokenization_drift`, tokens where a
    trajectory differs from what the engine was given and sampled (0 unless distrl has a bug), and
    `agent/template_drift_frac`, episodes that rendering their messages anew would have tokenized otherwise.
    `env/<name>` is the mean of each figure the environments reported by name (`Episode.metrics`) over the
    episodes that reported it.

    Figures are per episode: an episode trained as several sequences (`Episode.segment`) counts once, by its
    segment-0 row, which carries its figures. `agent/sequences_per_episode` is the mean number of sequences an
    episode was trained as, `agent/non_continuations` the sequences that do not continue the one before them
    (segment > 0); `agent/masked_frac` counts the tokens of every sequence."""
    episodes = [e for e in rollouts.episodes if e.segment == 0]
    tokens = sum(len(m) for m in rollouts.loss_mask)
    out = {
        "agent/sequences_per_episode": len(rollouts.episodes) / len(episodes),
        "agent/non_continuations": float(len(rollouts.episodes) - len(episodes)),
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
    names = sorted({name for e in episodes for name in e.metrics})
    out.update({f"env/{name}": statistics.fmean(e.metrics[name] for e in episodes if name in e.metrics)
                for name in names})
    return out
