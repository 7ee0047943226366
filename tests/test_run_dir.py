"""The run directory never mixes two runs; step times and overhead add up; metric merging keeps min/max meaning;
rewards see the answer; resumed runs reseed the engines."""

import json
import time
from types import SimpleNamespace

import pytest

from distrl import config
from distrl.cluster.generation import reward_sample
from distrl.cluster.roles import engine_seed
from distrl.run_dir import RunDir
from distrl.types import Prompt, Rollouts
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
    with pytest.raises(FileExistsError, match=r"run\.resume=true .* run\.overwrite=true"):
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


def test_step_times_add_up_and_overhead_is_what_the_driver_did_itself(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    run = RunDir(cfg(tmp_path))
    rollouts = Rollouts(prompt_ids=[[1], [1]], response_ids=[[2, 3], [4]], rollout_logprobs=[[0.0, 0.0], [0.0]],
                        response_texts=["a", "b"], finish_reasons=["stop", "length"], group=[0, 0], policy_version=0)
    sync, stats = SimpleNamespace(bytes=8, bytes_per_s=4.0), SimpleNamespace(dropped=0)
    rows = []
    for step in run.progress(range(1, 3)):
        now[0] += 2.0  # a step: waits for actors 1.5 s, advantages 0.1 s, 0.4 s of other driver work
        times = {"time/generate": 1.0, "time/update": 0.5, "time/advantages": 0.1}
        rows.append(run.step_metrics(step, rollouts, [1.0, 0.0], 0, {}, {}, sync, times, stats))
        now[0] += 0.25  # logging step k: charged to step k+1
    run.close()
    assert [r["time/step"] for r in rows] == [2.0, 2.25]
    # overhead = step - waits; advantages is the driver's own work, so it stays in
    assert [r["time/driver_overhead"] for r in rows] == pytest.approx([0.5, 0.75])
    assert rows[0]["throughput/tokens_per_s"] == pytest.approx(3 / 2.0)


def test_resumed_runs_move_the_engine_seed_on():
    c = config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "rollout": {"seed": 5}})
    assert engine_seed(c, first_step=1) == 5 and engine_seed(c, first_step=4) == 5 + 3 * 7919
    derived = config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "run": {"seed": 2}})
    assert engine_seed(derived, first_step=1) == 2000
