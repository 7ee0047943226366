"""The correction's alarms (`distrl.correction_watch`, `run.correction_alarm`): the bounds by hand, a warning once
per figure and age, a watch rebuilt from logged rows, and a run on the local backend that says so in its log and
rows."""

import math

import pytest

from distrl import config
from distrl.config.correction_alarm import CorrectionAlarmConfig
from distrl.correction_watch import CorrectionWatch
from distrl.driver import train
from tests.hf_rollout import HFRolloutWorker
from tests.test_driver_local import ROOT, local_config, rows

ESS_LOW, CUT_HIGH = "health/correction_ess_low", "health/correction_truncated_high"


def row(**figures: float | None) -> dict[str, float | None]:
    """A row holding `ess_1=0.4` as `correction/ess/staleness_1`, `frac_truncated_2=...` likewise ("2+": `_2p`)."""
    out = {}
    for name, value in figures.items():
        figure, age = name.rsplit("_", 1)
        out[f"correction/{figure}/staleness_{age.replace('p', '+')}"] = value
    return out


def watched(rows_: list[dict], **cfg) -> list[tuple[dict, list[str]]]:
    watch = CorrectionWatch(CorrectionAlarmConfig(**cfg))
    return [watch.observe(r) for r in rows_]


def test_ess_below_its_bound_for_steps_in_a_row_warns_once():
    # min_ess 0.5, steps 2: age 1's ESS 0.4 (1 step below), 0.6 (the row breaks), 0.3, 0.2 (2 in a row: warned),
    # 0.1 (3 in a row: counted, not warned again). Age 0's 0.9 is never below.
    got = watched([row(ess_0=0.9, ess_1=0.4), row(ess_0=0.9, ess_1=0.6), row(ess_0=0.9, ess_1=0.3),
                   row(ess_0=0.9, ess_1=0.2), row(ess_0=0.9, ess_1=0.1)], min_ess=0.5, steps=2)
    assert [g[0][ESS_LOW] for g in got] == [0, 0, 0, 1, 1]
    assert [len(g[1]) for g in got] == [0, 0, 0, 1, 0]
    assert [g[0][CUT_HIGH] for g in got] == [0] * 5
    warning = got[3][1][0]
    assert warning.startswith("the correction's effective sample size over the tokens of staleness 1 is 0.200, "
                              "below run.correction_alarm.min_ess (0.5) for 2 steps in a row")
    assert "lower loop.max_staleness" in warning and "rollout.dtype" not in warning


def test_each_figure_and_age_warns_once_for_the_whole_run():
    # steps 1: a recovery (age 0's share back under the bound) and a new rise do not warn again
    got = watched([row(frac_truncated_0=0.1), row(frac_truncated_0=0.01), row(frac_truncated_0=0.2),
                   row(frac_truncated_0=0.2, frac_truncated_2p=0.3)], max_frac_truncated=0.05, steps=1)
    assert [g[0][CUT_HIGH] for g in got] == [1, 0, 1, 2]
    assert [len(g[1]) for g in got] == [1, 0, 0, 1]
    assert got[0][1][0].startswith("loss.correction truncated the weight of 10.0% of the tokens of staleness 0, "
                                   "above run.correction_alarm.max_frac_truncated (5.0%) for 1 steps in a row")
    assert "check rollout.dtype against learner.dtype" in got[0][1][0]  # age 0: precision, not age
    assert "of staleness 2+" in got[3][1][0] and "lower loop.max_staleness" in got[3][1][0]


def test_the_bounds_themselves_are_not_past_them():
    # an ESS exactly at min_ess and a share exactly at max_frac_truncated are within bounds
    got = watched([row(ess_1=0.5, frac_masked_1=0.05)], min_ess=0.5, max_frac_truncated=0.05, steps=1)
    assert got[0] == ({ESS_LOW: 0.0, CUT_HIGH: 0.0}, [])
    masked = watched([row(frac_masked_1=0.06)], max_frac_truncated=0.05, steps=1)[0][1]
    assert masked[0].startswith("loss.correction masked the weight of 6.0% of the tokens of staleness 1")


def test_a_step_without_tokens_of_an_age_neither_counts_nor_breaks_the_row():
    # steps 2: age 2+ below at steps 1 and 3, absent (null or missing) at step 2: warned at step 3
    got = watched([row(ess_0=1.0, ess_2p=0.1), row(ess_0=1.0, ess_2p=None), row(ess_0=1.0), row(ess_0=1.0, ess_2p=0.1)],
                  min_ess=0.5, steps=2)
    assert [len(g[1]) for g in got] == [0, 0, 0, 1]


def test_non_finite_figures_are_past_their_bounds():
    got = watched([row(ess_0=math.nan, frac_truncated_0=math.nan)], steps=1)
    assert got[0][0] == {ESS_LOW: 1.0, CUT_HIGH: 1.0} and len(got[0][1]) == 2


def test_a_row_without_the_corrections_figures_has_null_counts():
    figures, warnings = watched([{"correction/mismatch_kl/staleness_0": 0.3, "correction/ess": 0.1}])[0]
    assert figures == {ESS_LOW: None, CUT_HIGH: None} and warnings == []


def test_a_watch_rebuilt_from_logged_rows_continues_as_the_one_that_saw_them():
    cfg = CorrectionAlarmConfig(min_ess=0.5, steps=2)
    logged = [row(ess_1=0.4), row(ess_1=0.3), row(ess_1=0.9), row(ess_1=0.4, ess_0=0.2), row(ess_1=0.4, ess_0=0.2)]
    whole = CorrectionWatch(cfg)
    expected = [whole.observe(r) for r in logged][3:]
    rebuilt = CorrectionWatch(cfg, logged[:3])
    assert [rebuilt.observe(r) for r in logged[3:]] == expected
    # age 1 warned before the rebuild (step 2) and is not warned again; age 0 is warned once, after it
    assert [len(w) for _, w in expected] == [0, 1] and "staleness 0" in expected[1][1][0]


@pytest.mark.parametrize("field,value", [("min_ess", 0.0), ("min_ess", 1.5), ("max_frac_truncated", 1.0),
                                         ("max_frac_truncated", -0.1), ("steps", 0)])
def test_bounds_out_of_range_are_refused(field, value):
    with pytest.raises(config.ConfigError, match=rf"run\.correction_alarm\.{field}"):
        config.load(ROOT / "configs" / "quickstart.yaml", [f"run.correction_alarm.{field}={value}"])


def test_a_run_whose_weights_are_cut_says_so_once_in_its_log_and_rows(tmp_path, tiny_model_dir, capsys):
    """Asynchronous, one version stale at most, TIS capped at 1.001: float32 rounding (ratios within 1e-6 of 1)
    truncates nothing, but from step 3 on (the first update that moved the weights was step 2's) a stale token whose
    ratio is above the cap is truncated. With a bound of 0, the tokens of staleness 1 set the alarm off at step 3,
    once; the run goes on, and step 4 still counts them."""
    cfg = local_config(tmp_path, tiny_model_dir, "loop.mode=async", "loop.max_staleness=1",
                       "loss.correction={mode: tis, low: 0.0, high: 1.001}",
                       "run.correction_alarm={max_frac_truncated: 0.0, steps: 1}")
    train(cfg, rollout_worker=HFRolloutWorker)
    logged = rows(cfg)
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert [r[CUT_HIGH] for r in logged] == [0, 0, 1, 1]
    assert [r[ESS_LOW] for r in logged] == [0, 0, 0, 0]  # capped near 1, the weights stay close to equal
    out = capsys.readouterr().out
    assert out.count("warning: step 3: loss.correction truncated the weight of") == 1
    assert out.count("run.correction_alarm") == 1  # once: not again at step 4, never for staleness 0
    assert "of the tokens of staleness 1, above run.correction_alarm.max_frac_truncated (0.0%)" in out
