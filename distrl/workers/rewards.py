"""Reward functions and the one place that calls them.

A reward function is `(prompt: str, completion: str, sample: dict) -> float`, where `sample` is the dataset row
(the reference answer sits under the data's `answer_key`; the built-ins read `sample["answer"]`). It may return a
mapping instead, `{"reward": float, ...}`, whose other (JSON-serialisable) keys are the sample's info: what answer
was extracted, what could not be (`math_answer` does so; evaluation writes the info with each sample and takes
`info["answer"]` for majority votes). Config names it as `package.module:function`; `resolve_reward` imports it
and `score_batch` scores a list of samples with it.
This module is plain Python: the Ray task that runs `score_batch` lives in `distrl.cluster.rewards`.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from distrl.imports import import_spec
from distrl.tasks.toy import toy_reward as toy

__all__ = ["RewardError", "Scores", "exact_match", "extract_number", "final_answer", "math_answer", "numeric_answer",
           "resolve_reward", "score_batch", "toy"]

RewardFn = Callable[[str, str, dict], float | Mapping[str, Any]]

NUMERIC_TOLERANCE = 1e-6
"""Relative tolerance of `numeric_answer` (absolute below magnitude 1), so that "3" equals "3.0"."""


class RewardError(RuntimeError):
    """A reward function raised or returned a non-finite / non-numeric value (with `reward.on_error: raise`)."""


# ------------------------------------------------------------------------------------------------------ resolving
def resolve_reward(spec: str) -> RewardFn:
    """Import the reward function that `spec` (`package.module:function`) names."""
    fn = import_spec(spec, "reward function", "function", "distrl.workers.rewards:exact_match")
    if not callable(fn):
        raise ValueError(f"reward function {spec!r} is a {type(fn).__name__}, not a callable")
    return fn


# -------------------------------------------------------------------------------------------------------- scoring
def _shorten(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


def reward_and_info(value: object) -> tuple[float, dict[str, Any]]:
    """`value` as a finite float and the sample's info (a mapping's keys besides "reward"); anything else is the
    reward function's error."""
    info: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "reward" not in value:
            raise TypeError(f"returned a mapping without a 'reward' key (keys: {sorted(value)})")
        info = {k: v for k, v in value.items() if k != "reward"}
        value = value["reward"]
    if not isinstance(value, numbers.Real):
        raise TypeError(f"returned {type(value).__name__} {value!r}, expected a float")
    if not math.isfinite(value):
        raise ValueError(f"returned a non-finite reward {value!r}")
    return float(value), info


@dataclass(frozen=True)
class Scores:
    """What scoring a list of samples gave: one reward and one info dict per sample, how many failed in the
    reward function (scored 0 under `on_error: zero`; their info holds the "error"), and the last failure."""

    rewards: list[float] = field(default_factory=list)
    infos: list[dict[str, Any]] = field(default_factory=list)
    errors: int = 0
    last: str | None = None

    @staticmethod
    def concat(parts: list[Scores]) -> Scores:
        last = next((p.last for p in reversed(parts) if p.last), None)
        return Scores([r for p in parts for r in p.rewards], [i for p in parts for i in p.infos],
                      sum(p.errors for p in parts), last)


def score_batch(spec: str, items: list[tuple[str, str, dict]], on_error: Literal["raise", "zero"] = "raise",
                first_index: int = 0) -> Scores:
    """Score `(prompt, completion, sample)` items with the function `spec` names; errors call item i
    "sample first_index + i" (the driver numbers a run's samples prompt ticket x n + j).

    A failure is an exception or a non-finite / non-numeric return value: with `on_error="raise"` it raises
    `RewardError` naming the function and the sample, chained to the original error; with `"zero"` the item
    scores 0.0 and is counted.
    """
    if on_error not in ("raise", "zero"):
        raise ValueError(f"on_error must be 'raise' or 'zero', got {on_error!r}")
    fn = resolve_reward(spec)
    rewards: list[float] = []
    infos: list[dict[str, Any]] = []
    errors, last = 0, None
    for i, (prompt, completion, sample) in enumerate(items):
        try:
            reward, info = reward_and_info(fn(prompt, completion, sample))
        # A user's reward function may raise anything; `reward.on_error` is the policy that decides what happens.
        except Exception as err:
            message = (f"reward function {spec} failed on sample {first_index + i} (prompt {_shorten(prompt)}, "
                       f"completion {_shorten(completion)}): {type(err).__name__}: {err}")
            if on_error == "raise":
                raise RewardError(message) from err
            reward, info = 0.0, {"error": message}
            errors, last = errors + 1, message
        rewards.append(reward)
        infos.append(info)
    return Scores(rewards, infos, errors, last)


# ------------------------------------------------------------------------------------------------ answer parsing
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_HASHES = re.compile(r"####\s*([^\n]*)")
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
# A number with an optional sign and currency sign; thousands separators only in groups of three ("1,234,567"),
# so that a list "1,2,3" reads as three numbers. No space after the sign: in "10 - 5" the last number is 5.
_NUMBER = re.compile(r"(?<![\w.])(?P<sign>[-+\u2212]?)(?:\\?\$\s*)?"
                     r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)")


def _last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for j in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j]
    return text[start:]  # unclosed (a truncated response): take what is there


def _marked_answer(text: str) -> str | None:
    """Content of the last `\\boxed{}`, else what follows the last `####`; None when the text has neither."""
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    hashes = _HASHES.findall(text)
    return hashes[-1] if hashes else None


def final_answer(text: str) -> str:
    """The answer part of a response: the last `\\boxed{}` content, else what follows the last `####`, else all."""
    marked = _marked_answer(text)
    return (text if marked is None else marked).strip()


def _number_value(match: re.Match) -> float:
    value = float(match["num"].replace(",", ""))
    return -value if match["sign"] in ("-", "\u2212") else value


def extract_number(text: str) -> float | None:
    """The numeric answer in `text`, or None.

    With a `\\boxed{}` or `####` answer: its `\\frac{a}{b}`, else its first number (None if it has none).
    Without: the last number anywhere. Handles signs, `$`, thousands commas (also LaTeX `{,}`) and decimals.
    """
    marked = _marked_answer(text)
    if marked is None:
        found = list(_NUMBER.finditer(text))
        return _number_value(found[-1]) if found else None
    marked = marked.replace("{,}", ",")
    frac = _FRAC.search(marked)
    if frac:
        num, den = (extract_number(part) for part in frac.groups())
        if num is not None and den:
            sign = -1.0 if marked[: frac.start()].rstrip().endswith("-") else 1.0
            return sign * num / den
    first = _NUMBER.search(marked)
    return _number_value(first) if first else None


def _normalize(text: str) -> str:
    return " ".join(text.split()).casefold()


def _reference(sample: dict, fn_name: str) -> str:
    answer = sample.get("answer")
    if answer is None:
        raise ValueError(f"{fn_name} needs the reference answer in sample['answer'], and this sample has none "
                         f"(keys: {sorted(sample)})")
    return str(answer)


# ------------------------------------------------------------------------------------------------------ built-ins
def exact_match(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when the completion's final answer equals `sample["answer"]` up to case and whitespace, else 0.0."""
    return float(_normalize(final_answer(completion)) == _normalize(final_answer(_reference(sample, "exact_match"))))


def numeric_answer(prompt: str, completion: str, sample: dict) -> float:
    """1.0 when the completion's numeric answer equals that of `sample["answer"]` (within a relative 1e-6).

    Both sides are read with `extract_number`, so a GSM8K reference solution ending in `#### 42` works as is.
    A completion without a number scores 0.0; a reference without one is an error.
    """
    reference = _reference(sample, "numeric_answer")
    expected = extract_number(reference)
    if expected is None:
        raise ValueError(f"numeric_answer: the reference answer {reference[:80]!r} contains no number")
    got = extract_number(completion)
    if got is None:
        return 0.0
    return float(abs(got - expected) <= NUMERIC_TOLERANCE * max(1.0, abs(expected)))


def math_answer(prompt: str, completion: str, sample: dict) -> dict[str, Any]:
    """1.0 when the completion's answer is mathematically equal to `sample["answer"]`'s, by Hugging Face's
    `math-verify` (boxed answers, LaTeX, fractions, units, sets; numbers to 6 digits), with GSM8K's `#### N`
    marker read first on either side, so a GSM8K reference solution works as it is. The info names the answer
    extracted ("answer", normalised so that equal answers compare equal), how ("extraction": "####", "boxed" or
    "text") and, when none was found, the "error". A reference with no readable answer is an error."""
    from distrl.workers.answers import check

    return check(_reference(sample, "math_answer"), completion)
