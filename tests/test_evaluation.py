"""Evaluation (`eval`): Chen et al.'s pass@k, majority votes and the set figures by hand; the eval section's
checks; held-out sets evaluated during training in both loops (local backend), their figures equal to the
estimators recomputed from the samples written to RUN_DIR/eval/."""

import json
import math
from pathlib import Path

import pytest

from distrl import config
from distrl.driver import train
from distrl.evaluation import EvalSample, figures, pass_at_k
from tests.hf_rollout import HFRolloutWorker
from tests.test_driver_local import ROOT, local_config, rows


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 2, 1 - 3 / 6),  # 1 - C(3, 2) / C(4, 2)
    (5, 2, 3, 1 - 1 / 10),  # 1 - C(3, 3) / C(5, 3)
    (5, 2, 1, 2 / 5),  # pass@1 is the fraction correct
    (5, 0, 5, 0.0),
    (5, 3, 3, 1.0),  # fewer than k wrong samples: every draw of k holds a correct one
])
def test_pass_at_k_is_chen_et_al_unbiased_estimator(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_refuses_counts_that_cannot_be():
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(3, 1, 4)


def sample(prompt, j, reward, answer=None, tokens=4, version=2):
    return EvalSample(prompt, f"q{prompt}", j, "c", reward, {} if answer is None else {"answer": answer}, tokens,
                      (version, version))


def test_set_figures_by_hand():
    # Prompt 0: one of three right, the majority ("7") wrong; prompt 1: two of three right, the majority right.
    samples = [sample(0, 0, 1.0, "5"), sample(0, 1, 0.0, "7"), sample(0, 2, 0.0, "7", version=1),
               sample(1, 0, 1.0, "3", tokens=7), sample(1, 1, 1.0, "3"), sample(1, 2, 0.0, "4", version=3)]
    got = figures("held", samples, n=3, threshold=1.0)
    assert got == pytest.approx({
        "eval/held/accuracy": 0.5, "eval/held/mean@3": 0.5,
        "eval/held/pass@1": (1 / 3 + 2 / 3) / 2,
        "eval/held/pass@2": ((1 - 1 / 3) + 1.0) / 2,  # prompt 0: 1 - C(2, 2) / C(3, 2)
        "eval/held/pass@3": 1.0,
        "eval/held/maj@3": 0.5,
        "eval/held/response_length/mean": 27 / 6, "eval/held/samples": 6.0,
        "eval/held/policy_version": 1.0, "eval/held/policy_version_max": 3.0})


def test_greedy_figures_without_answers_have_no_majority_vote():
    got = figures("g", [sample(0, 0, 0.25), sample(1, 0, 1.0)], n=1, threshold=1.0)
    assert got["eval/g/accuracy"] == 0.625 and got["eval/g/pass@1"] == 0.5
    assert "eval/g/maj@1" not in got and "eval/g/mean@1" not in got
    tie = figures("t", [sample(0, 0, 1.0, "5"), sample(0, 1, 0.0, "7"), sample(1, 0, 0.0, "2"),
                        sample(1, 1, 1.0, "3")], n=2, threshold=1.0)
    assert tie["eval/t/maj@2"] == 0.5  # a tied vote goes to the answer seen first: "5" (right), "2" (wrong)
    with pytest.raises(ValueError, match=r"every prompt needs 2 samples, prompts \[1\] have"):
        figures("g", [sample(0, 0, 1.0), sample(0, 1, 1.0), sample(1, 0, 1.0)], n=2, threshold=1.0)


def test_the_eval_section_is_checked_and_sets_take_the_data_spec():
    base = {"model": {"path": "m"}, "data": {"path": "d.jsonl", "chat_template": "always", "max_prompt_tokens": 99}}
    cfg = config.from_dict({**base, "eval": {"sets": [{"name": "held", "path": "h.jsonl", "max_prompt_tokens": 7}],
                                             "every": 5}})
    [held] = cfg.eval.sets
    assert (held.path, held.chat_template, held.max_prompt_tokens, held.shuffle) == ("h.jsonl", "always", 7, False)
    assert config.from_dict({**base, "data": {**base["data"], "prompt": "{q}"},
                             "eval": {"sets": [{"name": "h", "path": "h.jsonl"}]}}).eval.sets[0].prompt == "prompt"
    assert [s for s in range(1, 31) if cfg.eval.due(s, 30)] == [5, 10, 15, 20, 25, 30]
    hub = {**base, "data": {"path": "openai/gsm8k", "subset": "main", "split": "train", "prompt": "{question}",
                            "chat_template": "always"}}
    same, other = config.from_dict({**hub, "eval": {"sets": [
        {"name": "test", "path": "openai/gsm8k", "split": "test"},
        {"name": "mine", "path": "held.jsonl", "prompt_key": "q"}]}}).eval.sets
    assert (same.subset, same.split, same.prompt, same.chat_template) == ("main", "test", "{question}", "always")
    assert (other.subset, other.split, other.prompt, other.chat_template) == (None, None, "q", "always")
    with pytest.raises(ValueError, match=r"eval.sets\[0\] \(train\) reads the training data"):
        config.from_dict({**hub, "eval": {"sets": [{"name": "train", "path": "openai/gsm8k"}]}})
    with pytest.raises(ValueError, match="would all be the same"):
        config.from_dict({**base, "eval": {"sets": [{"name": "a", "path": "h"}], "sampling": {"n": 4}}})
    with pytest.raises(ValueError, match=r"names must differ, \['a'\]"):
        config.from_dict({**base, "eval": {"sets": [{"name": "a", "path": "h"}, {"name": "a", "path": "i"}]}})


def recomputed(path: Path, n: int) -> dict[str, float]:
    """pass@k and accuracy recomputed from written samples with the estimator written out here."""
    written = [json.loads(line) for line in path.read_text().splitlines()]
    correct: dict[int, int] = {}
    for row in written:
        correct[row["prompt_index"]] = correct.get(row["prompt_index"], 0) + (row["reward"] >= 1.0)
    out = {"accuracy": sum(r["reward"] for r in written) / len(written)}
    for k in range(1, n + 1):
        out[f"pass@{k}"] = sum(1 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0
                               for c in correct.values()) / len(correct)
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_held_out_sets_are_evaluated_during_training(tmp_path, tiny_model_dir, mode, capsys):
    toy = ROOT / "configs" / "data" / "toy.jsonl"
    cfg = local_config(tmp_path, tiny_model_dir, "rollout.dtype=float32", f"loop.mode={mode}",
                       "eval.every=2", "eval.sampling.n=3", "eval.sampling.temperature=1.0",
                       f'eval.sets=[{{"name": "toy", "path": "{toy}", "limit": 5}}, '
                       f'{{"name": "greedy", "path": "{toy}", "limit": 2}}]')
    history = train(cfg, rollout_worker=HFRolloutWorker)
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    printed = capsys.readouterr().out  # the summary: every evaluation of each set
    assert "held-out toy: accuracy " in printed and "(step 2) -> " in printed and "(step 4); samples in" in printed
    got = rows(cfg)
    evaluated = [r["step"] for r in got if "eval/toy/accuracy" in r]
    assert evaluated == [2, 4]
    for r in got:
        if r["step"] in evaluated:
            assert r["eval/toy/samples"] == 15.0 and r["eval/greedy/samples"] == 6.0 and r["time/eval"] > 0
            # In both loops the evaluated weights are the step's (the asynchronous one waits for that push).
            assert r["eval/toy/policy_version"] == r["eval/toy/policy_version_max"] == r["step"]
            written = Path(cfg.run.output_dir) / cfg.run.name / "eval" / "toy" / f"step_{r['step']:06d}.jsonl"
            for key, value in recomputed(written, 3).items():
                assert r[f"eval/toy/{key}"] == pytest.approx(value)


def test_an_evaluation_may_sample_longer_turns_than_training(tmp_path, tiny_model_dir):
    """eval.sampling.max_new_tokens above the training turn's is the evaluation's turn, and the engine's context
    is sized for the longer of the two (and for the longer prompts of the two)."""
    from distrl.agents.episode import EpisodeRunner
    from distrl.agents.trajectory import Budget

    toy = ROOT / "configs" / "data" / "toy.jsonl"
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        f"eval.sets=[{{name: toy, path: '{toy}', max_prompt_tokens: 100}}]", "eval.sampling.max_new_tokens=40"])
    assert (cfg.longest_prompt_tokens, cfg.longest_turn_tokens) == (100, 40)
    runner = EpisodeRunner(object(), object(), Budget.of(16, None, 200)).resampled(object(), 40)
    assert (runner.budget.max_new_tokens, runner.budget.max_tokens) == (40, 40)
