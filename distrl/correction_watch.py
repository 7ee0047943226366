"""A run whose correction stopped correcting says so: the IS weights of the tokens of some staleness have had a
normalised effective sample size below `min_ess`, or a share of tokens their bounds truncated or masked above
`max_frac_truncated`, for `steps` steps in a row (`run.correction_alarm`).

The correction (`loss.correction`) turns samples of the engine's policy into the learners' proximal policy's
expectation. While the two are close its weights are near 1; as they drift apart (a bfloat16 engine, stale weights
in the asynchronous loop) a few tokens carry most of the weight, or the bounds cut more and more of them, and the
update rests on fewer tokens than it trains on. The figures come split by staleness
(`correction/<figure>/staleness_<age>`, `distrl.loop.phases.correction_by_staleness`), so that an alarm says whether
the precision (age 0) or the age is to blame. The watch only reports: the loop prints each warning once per figure
and age, and every row carries how many ages are past each bound (`health/correction_ess_low`,
`health/correction_truncated_high`). Bookkeeping over the rows alone, so a resumed or recovered run rebuilds it from
the rows it kept and does not warn again of what it warned of before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from distrl.config.correction_alarm import CorrectionAlarmConfig

FIGURE = re.compile(r"correction/(ess|frac_truncated|frac_masked)/staleness_(.+)")
"""A row's per-staleness figure that the watch reads: (figure, age)."""
HEALTH = {"ess": "health/correction_ess_low", "frac_truncated": "health/correction_truncated_high",
          "frac_masked": "health/correction_truncated_high"}
"""The row figure that counts the ages past the bound, by watched figure."""


class CorrectionWatch:
    """Fed each step's row in step order (`rows`: the rows already logged, to continue from)."""

    def __init__(self, cfg: CorrectionAlarmConfig, rows: Iterable[Mapping[str, float | None]] = ()):
        self.cfg = cfg
        self.past: dict[tuple[str, str], int] = {}  # (figure, age) -> steps in a row past its bound
        self.warned: set[tuple[str, str]] = set()
        for row in rows:
            self.observe(row)

    def observe(self, row: Mapping[str, float | None]) -> tuple[dict[str, float | None], list[str]]:
        """Take one step's row. Returns the row's figures (`health/correction_ess_low`,
        `health/correction_truncated_high`: how many ages have been past that bound `steps` steps in a row; null in
        a row without the correction's figures) and the warnings of this step: one for each figure and age the first
        time it has been past its bound `steps` steps in a row."""
        counts = dict.fromkeys(sorted(set(HEALTH.values())), 0.0)
        watched = False
        warnings = []
        for key in sorted(row):
            match, value = FIGURE.fullmatch(key), row[key]
            if match is None or value is None:  # no token of that age in this step's batch
                continue
            figure, age = match.groups()
            watched = True
            # `not (x >= bound)` so that a non-finite figure (NaN weights) is past the bound too
            past = not value >= self.cfg.min_ess if figure == "ess" else not value <= self.cfg.max_frac_truncated
            steps = self.past[figure, age] = self.past.get((figure, age), 0) + 1 if past else 0
            if steps >= self.cfg.steps:
                counts[HEALTH[figure]] += 1
            if steps == self.cfg.steps and (figure, age) not in self.warned:
                self.warned.add((figure, age))
                warnings.append(self.warning(figure, age, value))
        figures: dict[str, float | None] = dict(counts) if watched else dict.fromkeys(counts)
        return figures, warnings

    def warning(self, figure: str, age: str, value: float) -> str:
        """What the run says when `figure` of the tokens of staleness `age` has been past its bound: which bound,
        and what to change (docs/correction.md, "When an alarm fires")."""
        steps = self.cfg.steps
        if figure == "ess":
            said = (f"the correction's effective sample size over the tokens of staleness {age} is {value:.3f}, below "
                    f"run.correction_alarm.min_ess ({self.cfg.min_ess:g}) for {steps} steps in a row: a few tokens "
                    f"carry the update")
        else:
            cut = "truncated" if figure == "frac_truncated" else "masked"
            said = (f"loss.correction {cut} the weight of {value:.1%} of the tokens of staleness {age}, above "
                    f"run.correction_alarm.max_frac_truncated ({self.cfg.max_frac_truncated:.1%}) for {steps} steps "
                    f"in a row: they are cut, not corrected")
        if age == "0":
            cause = ("at staleness 0 the engine and the learners hold the same weights, so the mismatch is "
                     "precision or kernels: check rollout.dtype against learner.dtype (a bfloat16 engine beside "
                     "float32 learners), and the sampler's top-k and top-p")
        else:
            cause = ("at this age the samples' weights are older than the learners': lower loop.max_staleness (or "
                     "learner.lr, which sets how far a version moves)")
        remedy = ("a lower loss.correction.high bounds the largest weights, and loss.correction.mode icepop or "
                  "seq_mask_tis drops the strays (their share is then what max_frac_truncated watches)"
                  if figure == "ess" else "wider bounds would only trade this for a lower effective sample size")
        return f"{said}. {cause[0].upper()}{cause[1:]}; {remedy} (docs/correction.md, \"When an alarm fires\")"
