"""The built-in reward functions (`reward.function: distrl.workers.rewards:<name>`) and the answer extraction they
share: the final answer of a completion (a boxed answer, one after "####", else the last number), compared exactly,
numerically or by `math-verify` (`distrl.workers.rewards.answers`)."""

from __future__ import annotations

import re
from typing import Any

NUMERIC_TOLERANCE = 1e-6
"""Relative tolerance of `numeric_answer` (absolute below magnitude 1), so that "3" equals "3.0"."""

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
    from distrl.workers.rewards.answers import check

    return check(_reference(sample, "math_answer"), completion)
