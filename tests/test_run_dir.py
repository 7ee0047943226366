"""The run directory never mixes two runs; metric merging keeps min/max meaning; rewards see the answer."""

import json

import pytest

from distrl import config
from distrl.cluster.generation import reward_sample
from distrl.run_dir import RunDir
from distrl.types import Prompt
from distrl.workers.learner import merge_metrics


def cfg(tmp_path, *overrides):
    run = {"output_dir": str(tmp_path), "tensorboard": False, "ray_metrics": False, "progress": False,
           **dict(overrides)}
    return config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "run": run})


def row(reward: float) -> dict:
    return {"reward/mean": reward, "loss/policy": 0.0, "throughput/tokens_per_s": 1.0, "time/step": 1.0}


def used_run(tmp_path, steps=3) -> RunDir:
    run = RunDir(cfg(tmp_path))
    for step in range(1, steps + 1):
        run.log(step, row(0.1 * step))
    run.close()
    return run


def test_a_used_run_directory_is_refused(tmp_path):
    used_run(tmp_path)
    with pytest.raises(FileExistsError, match="run.resume=true .* run.overwrite=true"):
        RunDir(cfg(tmp_path))


def test_overwrite_starts_afresh(tmp_path):
    run = used_run(tmp_path)
    RunDir(cfg(tmp_path, ("overwrite", True))).close()
    assert (run.path / "metrics.jsonl").read_text() == ""


def test_resume_forgets_steps_after_the_checkpoint(tmp_path):
    run = used_run(tmp_path, steps=3)
    resumed = RunDir(cfg(tmp_path, ("resume", True)))
    resumed.forget_after(1)
    resumed.log(2, row(9.0))
    resumed.close()
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.1), (2, 9.0)]


def test_merge_metrics_keeps_min_and_max_and_weights_means_by_tokens():
    # clip_frac 0.1 over 30 tokens and 0.3 over 10 tokens: (3 + 3) / 40 = 0.15 of all tokens were clipped
    merged = merge_metrics([{"is_weight_min": 0.5, "is_weight_max": 1.5, "clip_frac": 0.1, "learner/tokens": 30.0},
                            {"is_weight_min": 0.8, "is_weight_max": 2.0, "clip_frac": 0.3, "learner/tokens": 10.0}])
    assert merged == pytest.approx({"is_weight_min": 0.5, "is_weight_max": 2.0, "clip_frac": 0.15,
                                    "learner/tokens": 40.0})


def test_reward_sample_carries_the_answer_under_its_standard_key():
    prompt = Prompt(index=0, text="q", prompt_ids=[1], answer="42", sample={"question": "q", "target": "42"})
    assert reward_sample(prompt) == {"question": "q", "target": "42", "answer": "42"}
    assert reward_sample(Prompt(index=0, text="q", prompt_ids=[1], sample={"x": 1})) == {"x": 1}
