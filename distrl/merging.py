"""How a figure measured on one part of a batch becomes the figure of the whole.

Whoever makes a figure says how it merges (`Merge`), so no merge rule is guessed from a metric's name. A part is a
micro-batch, a learner's shard, or one optimizer step of an update; each part comes with its response-token count,
the weight of token means.

    TOKEN_MEAN  a mean over the part's response tokens (clip fraction, KL, importance weights): the token-weighted
                mean of the parts, so it comes out as over the whole batch
    SUM         a partial sum of one global quantity (a loss term divided by the global token count, a count of
                tokens): the parts add up
    MEAN        one value per part that is not a share of anything (a gradient norm, a learning rate, a loss
                already reduced over learners): the plain mean
    MIN / MAX   an extreme: the extreme over the parts that have tokens

Repeating a batch (PPO epochs, several optimizer steps in one update) is not splitting it: `over_steps` merges such
repetitions, where a SUM figure is already the whole of its step and so is averaged, and becomes a MEAN figure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum


class Merge(str, Enum):  # str: readable in messages and JSON (StrEnum is 3.11+)
    TOKEN_MEAN = "token_mean"
    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"


@dataclass(frozen=True)
class Figure:
    """A measured value and how it merges with the same figure of other parts."""

    value: float
    merge: Merge


Figures = dict[str, Figure]


def figures(values: Mapping[str, float], merge: Merge) -> Figures:
    """Every value of `values` as a Figure merged by `merge`."""
    return {key: Figure(float(value), merge) for key, value in values.items()}


def merge(parts: Sequence[Mapping[str, Figure]], tokens: Sequence[float]) -> Figures:
    """One figure per key from parts of one batch, given each part's response-token count. Every part must report
    the same keys with the same merge rule. A token mean over parts without any token is the plain mean."""
    if not parts:
        return {}
    if len(parts) != len(tokens):
        raise ValueError(f"merge: {len(parts)} parts but {len(tokens)} token counts")
    keys = list(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        if list(part) != keys:
            raise ValueError(f"merge: part {i} reports {sorted(part)}, part 0 reports {sorted(keys)}")
    weights = list(tokens) if sum(tokens) > 0 else [1.0] * len(parts)
    has_tokens = [w > 0 for w in weights]
    merged = {}
    for key in keys:
        rule = parts[0][key].merge
        values = []
        for i, part in enumerate(parts):
            if part[key].merge is not rule:
                raise ValueError(f"merge: {key!r} merges by {rule.value} in part 0 but by {part[key].merge.value} in "
                                 f"part {i}")
            values.append(part[key].value)
        merged[key] = Figure(_merge(rule, values, weights, has_tokens), rule)
    return merged


def over_steps(steps: Sequence[Mapping[str, Figure]], tokens: Sequence[float]) -> Figures:
    """One figure per key from the repetitions of a batch (optimizer steps, PPO epochs): as `merge`, except that a
    SUM figure is already whole in each step (summed over its parts and learners): it is averaged and comes out as
    MEAN, equal on every learner."""
    as_whole = [{k: Figure(f.value, Merge.MEAN) if f.merge is Merge.SUM else f for k, f in s.items()} for s in steps]
    return merge(as_whole, tokens)


def values(figs: Mapping[str, Figure]) -> dict[str, float]:
    """The plain values, for the metric sinks."""
    return {key: fig.value for key, fig in figs.items()}


def _merge(rule: Merge, values: list[float], weights: list[float], has_tokens: list[bool]) -> float:
    if rule is Merge.SUM:
        return sum(values)
    if rule is Merge.MEAN:
        return sum(values) / len(values)
    if rule is Merge.TOKEN_MEAN:
        return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)
    kept = [v for v, keep in zip(values, has_tokens, strict=True) if keep] or values
    return min(kept) if rule is Merge.MIN else max(kept)
