"""Math answers checked by Hugging Face's `math-verify`: extraction (boxed answers, LaTeX, fractions, units, plain
expressions) and equivalence (symbolic, numeric to 6 digits, sets and intervals), plus GSM8K's `#### N`
convention, which a reference solution and a completion may both end with.

math-verify bounds its parsing with SIGALRM, which only the main thread may set: off the main thread (an
environment's reward in a worker thread) it runs without its time limit.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Any

_LEADING_NUMBER = re.compile(r"\s*\$?\s*(-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?)(?![\d/])")
"""A number at the start of what follows `####` (thousands commas, decimals; not the numerator of a fraction)."""

PARSE_TIMEOUT_S = 5
"""math-verify's own limit on parsing or comparing one answer."""


@dataclass(frozen=True)
class Answer:
    """What was extracted from a text: math-verify's parse (empty when nothing was found), its normalised text
    form (sympy's: "1/2" for `\frac{1}{2}` and 0.5 alike, so answers can be compared and counted), and how it was
    found: "####" (after GSM8K's marker), "boxed" (the last `\\boxed{}`), or "text" (the last LaTeX or
    plain expression, without a marker)."""

    parsed: list[Any]
    text: str | None
    how: str

    @property
    def found(self) -> bool:
        return bool(self.parsed)


def _timeout() -> int | None:
    if threading.current_thread() is threading.main_thread():
        return PARSE_TIMEOUT_S
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # else it warns at every call that no limit is set
    return None


def extract(text: str) -> Answer:
    """The answer in `text`: after its last `####` the number that follows (else that line), otherwise
    math-verify's extraction (the last `\\boxed{}` first, then LaTeX, then a plain expression)."""
    from math_verify import parse

    how = "####" if "####" in text else "boxed" if "\\boxed" in text else "text"
    if how == "####":
        # GSM8K's answer is the number right after the marker: "#### 72. That is 3 more than 69." answers 72.
        after = text.rsplit("####", 1)[1]
        leading = _LEADING_NUMBER.match(after)
        text = leading.group(1) if leading else after.strip().split("\n", 1)[0]
    parsed = parse(text, parsing_timeout=_timeout())
    return Answer(parsed, str(parsed[0]) if parsed else None, how)


def equivalent(reference: Answer, answer: Answer) -> bool:
    """Whether `answer` is `reference` up to math-verify's equivalence (False when either was not found)."""
    from math_verify import verify

    if not (reference.found and answer.found):
        return False
    return bool(verify(reference.parsed, answer.parsed, timeout_seconds=_timeout()))


def check(reference_text: str, completion: str) -> dict[str, Any]:
    """Score `completion` against `reference_text`: {"reward": 1.0 or 0.0, "answer": the completion's answer
    (text, or None), "extraction": how it was found, and "error" naming what could not be extracted, if
    anything}."""
    reference = extract(reference_text)
    if not reference.found:
        looked = "after ####" if reference.how == "####" else "for a boxed, LaTeX or plain answer"
        raise ValueError(f"the reference answer {reference_text[:80]!r} holds no answer math-verify can read "
                         f"(looked {looked})")
    answer = extract(completion)
    info: dict[str, Any] = {"reward": float(equivalent(reference, answer)), "answer": answer.text,
                            "extraction": answer.how}
    if not answer.found:
        where = "after its ####" if answer.how == "####" else (
            "in its \\boxed{}" if answer.how == "boxed" else "(no \\boxed{} or ####, no LaTeX or number)")
        info["error"] = f"no answer found in the completion {where}"
    return info
