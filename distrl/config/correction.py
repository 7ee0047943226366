"""`loss.correction`: the importance-sampling correction of the rollout/trainer mismatch, told apart by `mode`.

The weights come from old_logprobs - rollout_logprobs (`distrl.algo.correction`). `tis` and `icepop` bound a token
ratio or a sequence's product ratio (`level`); `seq_mask_tis` masks whole sequences by their geometric-mean ratio, so
it has no `level`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from distrl.config.base import Section, Variants


def _check_bounds(low: float, high: float) -> None:
    if not low < high:
        raise ValueError(f"loss.correction.low ({low}) must be < loss.correction.high ({high})")


class RatioCorrection(Section):
    mode: Literal["tis", "icepop"] = "tis"
    """`tis`: truncate the ratio into [low, high] (truncated IS); `icepop`: zero tokens whose ratio leaves it."""
    level: Literal["token", "sequence"] = "token"
    """`token`: each token's own ratio; `sequence`: the sequence's product ratio on every token of it."""
    low: float = Field(default=0.0, ge=0.0)
    """Lower bound of the ratio (0 gives TIS's one-sided cap)."""
    high: float = Field(default=2.0, gt=0.0)
    """Upper bound of the ratio."""

    @model_validator(mode="after")
    def _bounds(self) -> RatioCorrection:
        _check_bounds(self.low, self.high)
        return self


class SeqMaskTISCorrection(Section):
    mode: Literal["seq_mask_tis"] = "seq_mask_tis"
    """Keep the token ratios, but zero every token of a sequence whose geometric-mean ratio leaves [low, high]
    (sequence-masked by construction)."""
    low: float = Field(default=0.0, ge=0.0)
    """Lower bound of the geometric-mean ratio."""
    high: float = Field(default=2.0, gt=0.0)
    """Upper bound of the geometric-mean ratio."""

    @model_validator(mode="after")
    def _bounds(self) -> SeqMaskTISCorrection:
        _check_bounds(self.low, self.high)
        return self


CORRECTION = Variants("mode", "tis", {"tis": RatioCorrection, "icepop": RatioCorrection,
                                      "seq_mask_tis": SeqMaskTISCorrection})
CorrectionConfig = Annotated[RatioCorrection | SeqMaskTISCorrection, Field(discriminator="mode"), CORRECTION.shorthand]
"""`loss.correction: icepop` is shorthand for `{mode: icepop}` (token level, bounds [0, 2])."""
