"""Built-in rewards (table-driven), resolving `module:function` specs, `score_batch`'s error policies, and the stop
when most of a step's samples fail."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

from distrl.cluster.rewards import check_failures
from distrl.config import RewardConfig
from distrl.tasks.toy import toy_reward
from distrl.workers.rewards import (
    RewardError,
    Scores,
    exact_match,
    extract_number,
    numeric_answer,
    resolve_reward,
    score_batch,
)

GSM8K_REFERENCE = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize("completion, answer, expected", [
    ("42", "42", 1.0),
    ("  Paris \n", "paris", 1.0),                          # strip + casefold
    ("New   York", "new york", 1.0),                       # inner whitespace collapsed
    ("so the answer is \\boxed{Paris}", "PARIS", 1.0),     # final answer from \boxed{}
    ("first \\boxed{Rome}, no wait \\boxed{Paris}", "Paris", 1.0),  # the last box counts
    ("work...\n#### 72", GSM8K_REFERENCE, 1.0),            # both sides read after ####
    ("Paris!", "Paris", 0.0),
    ("the answer is Paris", "Paris", 0.0),                 # no marker: the whole completion must match
    ("", "Paris", 0.0),
])
def test_exact_match(completion, answer, expected):
    assert exact_match("q", completion, {"answer": answer}) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("#### 72", GSM8K_REFERENCE, 1.0),
    ("#### 71", GSM8K_REFERENCE, 0.0),
    ("She sold 24 then 48, so \\boxed{72}.", "72", 1.0),
    ("\\boxed{72} but later 5", "72", 1.0),                # the boxed answer beats a later number
    ("#### 1,234,567", "1234567", 1.0),                    # thousands separators
    ("\\boxed{1{,}000}", "1000", 1.0),                     # LaTeX thousands separator
    ("The cost is $1,234.50 in total", "1234.5", 1.0),     # no marker: last number, with $ and decimals
    ("#### $18", "18", 1.0),
    ("\\boxed{\\$18}", "18", 1.0),
    ("#### -5", "-5", 1.0),
    ("\\boxed{-5}", "5", 0.0),                             # sign matters
    ("-$5", "-5", 1.0),
    ("#### 3.0", "3", 1.0),                                # numeric, not string, comparison
    ("#### 0.3333334", "0.3333333", 1.0),                  # within the 1e-6 tolerance
    ("#### 0.334", "0.333", 0.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("\\boxed{-\\dfrac{1}{2}}", "-0.5", 1.0),
    ("10 - 5", "5", 1.0),                                  # a spaced minus is an operator, not a sign
    ("1,2,3", "3", 1.0),                                   # a list, not one number: the last is 3
    ("no answer here", "42", 0.0),
    ("#### forty-two", "42", 0.0),                         # a marked answer without a number
    ("\\boxed{x} and 42", "42", 0.0),
    ("", "42", 0.0),
])
def test_numeric_answer(completion, answer, expected):
    assert numeric_answer("q", completion, {"answer": answer}) == expected


def test_extract_number_prefers_the_last_marker_and_first_number_inside_it():
    assert extract_number("#### 5\nlater: #### 6 apples 7") == 6.0
    assert extract_number("\\boxed{1} \\boxed{2}") == 2.0
    assert extract_number("\\boxed{x = 12 or 13}") == 12.0
    assert extract_number("values 3, 8 and 9") == 9.0
    assert extract_number("#### -5") == -5.0
    assert extract_number("-$1,000.5") == -1000.5
    assert extract_number("\\boxed{+2}") == 2.0
    assert extract_number("nothing") is None


@pytest.mark.parametrize("fn", [exact_match, numeric_answer])
def test_builtins_need_a_reference_answer(fn):
    with pytest.raises(ValueError, match=r"sample\['answer'\].*keys: \['question'\]"):
        fn("q", "42", {"question": "q"})


def test_numeric_answer_rejects_a_reference_without_a_number():
    with pytest.raises(ValueError, match="contains no number"):
        numeric_answer("q", "42", {"answer": "forty-two"})


@pytest.mark.parametrize("completion, expected", [
    ("123", 1.0), (" 12 34 ", 1.0), ("12ab", 0.5), ("abc", 0.0), ("", 0.0), ("   ", 0.0), ("1\n\t2 x y", 0.5),
])
def test_toy_reward_is_the_digit_fraction_of_visible_characters(completion, expected):
    assert toy_reward("Count on: 1 2", completion, {}) == expected


# ------------------------------------------------------------------------------------------------------ resolving
def test_resolve_builtins():
    assert resolve_reward("distrl.workers.rewards:exact_match") is exact_match
    assert resolve_reward("distrl.workers.rewards:toy") is toy_reward


@pytest.mark.parametrize("spec, message", [
    ("distrl.workers.rewards.exact_match", "must be written 'package.module:function'"),
    (":exact_match", "must be written"),
    ("distrl.workers.rewards:", "must be written"),
    ("distrl.no_such_module:f", "cannot import module 'distrl.no_such_module'"),
    ("distrl.workers.rewards:no_such_fn", "has no attribute 'no_such_fn'"),
    ("distrl.workers.rewards:NUMERIC_TOLERANCE", "is a float, not a callable"),
])
def test_resolve_errors_name_the_spec(spec, message):
    with pytest.raises(ValueError, match="reward function") as info:
        resolve_reward(spec)
    assert repr(spec) in str(info.value) and message in str(info.value)


# -------------------------------------------------------------------------------------------------------- scoring
PLUGIN = "distrl_test_reward_plugin"


@pytest.fixture
def plugin(tmp_path, monkeypatch) -> str:
    """A user reward module on sys.path whose function misbehaves on chosen completions."""
    (tmp_path / f"{PLUGIN}.py").write_text(textwrap.dedent("""
        def reward(prompt, completion, sample):
            if completion == "boom":
                raise ZeroDivisionError("division by zero in user code")
            return {"nan": float("nan"), "inf": float("inf"), "text": "0.5", "true": True}.get(completion, 0.25)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, PLUGIN, raising=False)
    return f"{PLUGIN}:reward"


def _items(*completions: str) -> list[tuple[str, str, dict]]:
    return [(f"prompt {i}", c, {"answer": "1"}) for i, c in enumerate(completions)]


def test_score_batch_scores_every_item(plugin):
    assert score_batch(plugin, _items("a", "true", "b")) == Scores([0.25, 1.0, 0.25], [{}, {}, {}])
    assert score_batch("distrl.workers.rewards:numeric_answer", _items("#### 1", "2")) == Scores([1.0, 0.0], [{}, {}])
    assert score_batch(plugin, []) == Scores()


def test_score_batch_raise_names_function_and_sample_and_chains(plugin):
    long_prompt = "p" * 500
    items = [*_items("ok"), (long_prompt, "boom", {})]
    with pytest.raises(RewardError) as info:
        score_batch(plugin, items, on_error="raise")
    message = str(info.value)
    assert PLUGIN + ":reward" in message and "sample 1" in message
    assert "'boom'" in message and "ZeroDivisionError: division by zero in user code" in message
    assert "p" * 80 + "..." in message and "p" * 81 not in message  # the prompt is shortened
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    # In a reward task scoring rows 64.. of the step, the failing item is named by its row in the step.
    with pytest.raises(RewardError, match="sample 65 "):
        score_batch(plugin, items, on_error="raise", first_index=64)


@pytest.mark.parametrize("completion, message", [
    ("nan", "non-finite reward nan"), ("inf", "non-finite reward inf"), ("text", "returned str '0.5'"),
])
def test_score_batch_treats_bad_values_as_errors(plugin, completion, message):
    with pytest.raises(RewardError, match=message):
        score_batch(plugin, _items("ok", completion), on_error="raise")
    scores = score_batch(plugin, _items("ok", completion), on_error="zero")
    rewards, errors, last = scores.rewards, scores.errors, scores.last
    assert scores.infos[0] == {} and scores.infos[1] == {"error": last}
    assert (rewards, errors) == ([0.25, 0.0], 1) and message in last


def test_score_batch_zero_scores_and_counts_failures(plugin):
    scores = score_batch(plugin, _items("boom", "a", "boom", "nan"), on_error="zero", first_index=10)
    rewards, errors, last = scores.rewards, scores.errors, scores.last
    assert rewards == [0.0, 0.25, 0.0, 0.0] and errors == 3
    assert all(math.isfinite(r) for r in rewards)
    assert last.startswith(f"reward function {plugin} failed on sample 13") and "non-finite reward nan" in last


def test_a_step_in_which_most_samples_fail_stops_the_run_with_the_last_error():
    cfg, last = RewardConfig(on_error="zero"), "reward function f failed on sample 3: KeyError: 'x'"
    check_failures(4, 8, last, cfg, step=2)  # half: goes on
    with pytest.raises(RewardError, match=r"5 of the 8 samples scored for step 2 failed .* reward\.max_error_frac = "
                                          r"0\.5.* The last failure: reward function f failed on sample 3: KeyError"):
        check_failures(5, 8, last, cfg, step=2)
    check_failures(8, 8, last, RewardConfig(on_error="zero", max_error_frac=1.0), step=2)  # 1.0: never stops


def test_score_batch_configuration_errors_are_not_per_sample(plugin):
    with pytest.raises(ValueError, match="on_error must be"):
        score_batch(plugin, _items("a"), on_error="ignore")
    with pytest.raises(ValueError, match="no_such_fn"):  # a bad spec fails even with on_error="zero"
        score_batch("distrl.workers.rewards:no_such_fn", _items("a"), on_error="zero")


# ----------------------------------------------------------------------------------- math-verify (math_answer)
@pytest.mark.parametrize(("reference", "completion", "reward", "answer", "extraction"), [
    ("Natalia sold 48/2 = 24 clips. #### 72", "48 + 24 = 72, so #### 72", 1.0, "72", "####"),  # GSM8K both sides
    ("#### 1,234", "The answer is $1,234$.", 1.0, "1234", "text"),
    ("\\frac{1}{2}", "So it is \\boxed{0.5}.", 1.0, "1/2", "boxed"),
    ("\\boxed{\\frac{\\pi}{2}}", "x = \\boxed{\\pi/2}", 1.0, "pi/2", "boxed"),
    ("\\boxed{3\\sqrt{2}}", "\\boxed{\\sqrt{18}}", 1.0, "sqrt(18)", "boxed"),
    ("5", "The length is \\boxed{5\\text{ cm}}", 1.0, "5", "boxed"),
    ("#### -3", "answer: -3", 1.0, "-3", "text"),
    ("#### 72", "It is 71 clips.", 0.0, "71", "text"),
    ("#### 72", "#### 72. That is 3 more than 69.", 1.0, "72", "####"),  # the number right after the marker
    ("#### 1,234", "#### $1,234 in all", 1.0, "1234", "####"),
    ("#### 0.5", "#### 1/2", 1.0, "1/2", "####"),  # a fraction after the marker is read whole
])
def test_math_answer_checks_answers_with_math_verify(reference, completion, reward, answer, extraction):
    from distrl.workers.rewards import math_answer

    assert math_answer("q", completion, {"answer": reference}) == {"reward": reward, "answer": answer,
                                                                 "extraction": extraction}


@pytest.mark.parametrize(("completion", "error"), [
    ("I do not know", "no answer found in the completion (no \\boxed{} or ####, no LaTeX or number)"),
    ("#### ten", "no answer found in the completion after its ####"),
])
def test_math_answer_names_the_extraction_that_failed(completion, error):
    from distrl.workers.rewards import math_answer

    info = math_answer("q", completion, {"answer": "#### 10"})
    assert info["reward"] == 0.0 and info["answer"] is None and info["error"] == error


def test_math_answer_refuses_a_reference_without_an_answer_and_runs_off_the_main_thread():
    import threading

    from distrl.workers.rewards import math_answer

    with pytest.raises(ValueError, match="holds no answer math-verify can read"):
        math_answer("q", "1", {"answer": "#### none"})
    out: list[dict] = []
    worker = threading.Thread(target=lambda: out.append(math_answer("q", "\\boxed{7}", {"answer": "#### 7"})))
    worker.start()
    worker.join()
    assert out == [{"reward": 1.0, "answer": "7", "extraction": "boxed"}]


def test_a_reward_may_return_its_info_beside_the_reward():
    scores = score_batch("distrl.workers.rewards:math_answer", [("q", "#### 3", {"answer": "3"}),
                                                              ("q", "no", {"answer": "3"})])
    assert scores.rewards == [1.0, 0.0] and scores.infos[0] == {"answer": "3", "extraction": "####"}
    assert scores.infos[1]["error"].startswith("no answer found")
    with pytest.raises(RewardError, match="returned a mapping without a 'reward' key"):
        score_batch("tests.test_rewards:_no_reward_key", [("q", "c", {})])


def _no_reward_key(prompt, completion, sample):
    return {"score": 1.0}
