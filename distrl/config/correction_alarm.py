"""`run.correction_alarm`: when a run says that the correction's importance weights, of tokens of some age, have
stopped being a sound correction (`distrl.correction_watch`)."""

from __future__ import annotations

from pydantic import Field

from distrl.config.base import Section


class CorrectionAlarmConfig(Section):
    min_ess: float = Field(default=0.5, gt=0.0, le=1.0)
    """Warn when the normalised effective sample size of the IS weights of the tokens of some age
    (`correction/ess/staleness_<age>`: 1 when every weight is equal, 1/N when one weight carries the batch) is below
    this, `steps` steps in a row: the step's gradient then rests on fewer tokens than it trains on. 0.5 is the
    usual bound of sequential Monte Carlo for resampling."""
    max_frac_truncated: float = Field(default=0.05, ge=0.0, lt=1.0)
    """Warn when the share of the tokens of some age whose weight the correction's bounds changed
    (`correction/frac_truncated/staleness_<age>` for `tis`, `correction/frac_masked/staleness_<age>` for `icepop`
    and `seq_mask_tis`) is above this, `steps` steps in a row: that many tokens are no longer corrected but cut."""
    steps: int = Field(default=3, gt=0)
    """Steps in a row a figure of one age must be past its bound before the run warns (one step's figure over a few
    tokens of an age is noisy). Steps whose batch holds no token of that age neither count nor break the row."""
