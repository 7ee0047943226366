"""The run directory never mixes two runs, overwrites only distrl's own files and is not left behind holding no
step; step times and overhead add up; metric merging keeps min/max meaning; rewards see the answer; each prompt's
sampling seed depends on the run's seed and the prompt's ticket only."""

import json
import math
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from distrl import checkpoint, config
from distrl.agents.figures import episode_metrics
from distrl.cluster.roles import actor_env, role_threads, sampling_seed
from distrl.loop.recovery import check_shared_run_dir
from distrl.preflight import PreflightError
from distrl.run_dir import RunDir
from distrl.types.prompt import Prompt
from distrl.types.rollouts import Episode, ScoredRollouts
from distrl.workers.device import granted_device
from distrl.workers.rollout.sampling import request_seed
from tests.one_turn import one_turn
from tests.test_checkpoint import saved


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
    again = RunDir(cfg(tmp_path, ("overwrite", True)))
    again.log(1, row(7.0))
    again.close()
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 7.0)]


def test_overwrite_deletes_only_what_distrl_wrote(tmp_path):
    run = used_run(tmp_path)
    (run.path / "checkpoints" / "step_000001").mkdir(parents=True)
    (run.path / "notes.txt").write_text("mine")
    (run.path / "data").mkdir()
    (run.path / "data" / "prompts.jsonl").write_text("{}\n")
    (tmp_path / "beside.txt").write_text("outside the run directory")
    RunDir(cfg(tmp_path, ("overwrite", True))).close()
    assert not (run.path / "checkpoints").exists()
    assert (run.path / "notes.txt").read_text() == "mine"
    assert (run.path / "data" / "prompts.jsonl").exists()
    assert (tmp_path / "beside.txt").exists()


def test_overwrite_removes_a_linked_checkpoint_directory_but_not_what_it_points_to(tmp_path):
    run = used_run(tmp_path / "runs")
    elsewhere = tmp_path / "big-disk"
    (elsewhere / "step_000001").mkdir(parents=True)
    (run.path / "checkpoints").symlink_to(elsewhere)
    RunDir(cfg(tmp_path / "runs", ("overwrite", True))).close()
    assert not (run.path / "checkpoints").exists() and (elsewhere / "step_000001").is_dir()


def test_resume_forgets_steps_after_the_checkpoint(tmp_path):
    run = used_run(tmp_path, steps=3)
    saved(run.path, 1)
    resumed = RunDir(cfg(tmp_path, ("resume", True)))
    resumed.forget_after(1)
    resumed.log(2, row(9.0))
    resumed.close()
    rows = [json.loads(line) for line in (run.path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.1), (2, 9.0)]


@pytest.mark.parametrize("with_checkpoint", [True, False])
def test_resume_with_overwrite_continues_a_checkpointed_run_and_replaces_one_without(tmp_path, with_checkpoint):
    # The quickstart sets overwrite; `--set run.resume=true` must continue it, not delete what it would resume.
    run = used_run(tmp_path)
    if with_checkpoint:
        saved(run.path, 3)
    RunDir(cfg(tmp_path, ("overwrite", True), ("resume", True))).close()
    assert (run.path / "metrics.jsonl").is_file() == with_checkpoint
    assert (run.path / "checkpoints").is_dir() == with_checkpoint


def test_metrics_rows_keep_non_finite_figures_and_null_for_the_unmeasured(tmp_path):
    run = RunDir(cfg(tmp_path))
    run.log(1, {**row(0.5), "loss/policy": float("nan"), "learner/grad_norm": float("inf"), "kl/ref": None})
    run.close()
    line = (run.path / "metrics.jsonl").read_text()
    assert '"loss/policy": NaN' in line and '"learner/grad_norm": Infinity' in line and '"kl/ref": null' in line
    back = json.loads(line)  # Python's json (and pandas) read them back as floats
    assert math.isnan(back["loss/policy"]) and back["learner/grad_norm"] == math.inf and back["kl/ref"] is None


def test_resume_of_a_run_without_a_usable_checkpoint_is_refused_rather_than_restarted(tmp_path):
    # Starting at step 1 would truncate metrics.jsonl and mix two runs' TensorBoard events.
    run = used_run(tmp_path)
    with pytest.raises(FileExistsError, match=r"run\.resume: .* holds a run but no usable checkpoint .* Set "
                                              r"run\.overwrite=true \(and run\.resume=false\)"):
        RunDir(cfg(tmp_path, ("resume", True)))
    (run.path / "checkpoints" / "step_000002.damaged").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="only checkpoints set aside as damaged"):
        RunDir(cfg(tmp_path, ("resume", True)))
    assert (run.path / "metrics.jsonl").read_text().count("\n") == 3  # untouched


def test_a_prompts_row_carries_the_answer_under_its_standard_key():
    prompt = Prompt(index=0, text="q", prompt_ids=[1], answer="42", sample={"question": "q", "target": "42"})
    assert prompt.row() == {"question": "q", "target": "42", "answer": "42"}
    assert Prompt(index=0, text="q", prompt_ids=[1], sample={"x": 1}).row() == {"x": 1}


def test_step_times_add_up_and_overhead_is_what_the_driver_did_itself(tmp_path, monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    run = RunDir(cfg(tmp_path))
    rollouts = one_turn(prompt_ids=[[1], [1]], response_ids=[[2, 3], [4]], rollout_logprobs=[[0.0, 0.0], [0.0]],
                        response_texts=["a", "b"], finish_reasons=["stop", "length"], group=[0, 0],
                        policy_version=[0, 0])
    scored = ScoredRollouts(rollouts, [1.0, 0.0])
    sync, stats = SimpleNamespace(bytes=8, bytes_per_s=4.0), SimpleNamespace(dropped=0)
    rows = []
    for step in run.progress(range(1, 3)):
        now[0] += 2.0  # a step: waits for actors 1.5 s, advantages 0.1 s, 0.4 s of other driver work
        times = {"time/generate": 1.0, "time/update": 0.5, "time/advantages": 0.1}
        rows.append(run.step_metrics(step, scored, {}, sync, times, stats))
        now[0] += 0.25  # logging step k: charged to step k+1
    run.close()
    assert [r["time/step"] for r in rows] == [2.0, 2.25]
    # overhead = step - waits; advantages is the driver's own work, so it stays in
    assert [r["time/driver_overhead"] for r in rows] == pytest.approx([0.5, 0.75])
    assert rows[0]["throughput/tokens_per_s"] == pytest.approx(3 / 2.0)


def test_each_prompt_has_its_own_sampling_seed_from_the_run_seed_and_its_ticket():
    c = config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "rollout": {"seed": 5}})
    derived = config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "run": {"seed": 2}})
    assert sampling_seed(c) == 5 and sampling_seed(derived) == 2000
    seeds = [request_seed(5, ticket) for ticket in range(1000)]
    assert seeds == [request_seed(5, ticket) for ticket in range(1000)]  # a pure function: any engine, any restart
    assert len(set(seeds)) == 1000 and seeds != [request_seed(6, ticket) for ticket in range(1000)]
    # vLLM seeds a request's j-th sample with seed + j: 56 bits leave room below 2**63.
    assert all(0 <= s < 2**56 for s in seeds)


def test_a_run_that_logs_no_step_leaves_no_directory_behind(tmp_path):
    run = RunDir(cfg(tmp_path / "new" / "runs", ("tensorboard", True)))
    assert (run.path / "tensorboard").is_dir() and (run.path / "config.yaml").is_file()
    run.close()  # as when the run fails before its first step
    assert not (tmp_path / "new").exists()


def test_a_failed_start_removes_only_what_it_created(tmp_path):
    used_run(tmp_path)
    run = RunDir(cfg(tmp_path, ("overwrite", True)))
    (run.path / "notes.txt").write_text("mine")
    run.close()
    assert sorted(p.name for p in run.path.iterdir()) == ["notes.txt"]  # the old run is gone, as asked; mine stays
    beside = RunDir(cfg(tmp_path, ("name", "other")))
    beside.close()
    assert not beside.path.exists() and tmp_path.is_dir()  # output_dir was there before: it stays


def test_the_run_directory_is_absolute_whatever_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run = RunDir(cfg(tmp_path, ("output_dir", "runs")))
    assert run.path == tmp_path / "runs" / "run" and run.path.is_absolute()
    run.close()


@pytest.mark.parametrize("seen", ["missing", "different", "same"])
def test_training_needs_every_learner_to_see_the_drivers_run_directory(tmp_path, seen):
    """The driver resumes from what the learners write (sharded ones each their shards): storage not shared with
    any of them is refused at the start, naming it."""
    run = RunDir(cfg(tmp_path))
    same = checkpoint.seen_digest(run.path / "config.yaml")
    digest = {"missing": None, "different": "0" * 64, "same": same}
    roles = SimpleNamespace(backend=SimpleNamespace(answer=lambda value, what, timeout_s: value),
                            learner=SimpleNamespace(map=lambda method, path: [same, digest[seen]], role="learner",
                                                    name=lambda i: f"learner-{i}"), critic=None)
    if seen == "same":
        check_shared_run_dir(run, roles)
    else:
        with pytest.raises(PreflightError, match=rf"run\.output_dir: learner-1 does not see the run directory "
                                                 rf"{run.path} .*config\.yaml is {seen} on learner-1's node"):
            check_shared_run_dir(run, roles)
    run.close()


def test_a_directory_without_steps_is_not_a_run(tmp_path):
    # What a failed start left before this rule: config.yaml and an empty metrics.jsonl.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("old")
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    run = RunDir(cfg(tmp_path))
    run.log(1, row(0.5))
    run.close()
    assert (run.path / "config.yaml").read_text() != "old" and len(run.path.joinpath("metrics.jsonl").read_text()) > 0


def test_a_run_with_steps_keeps_everything_on_close(tmp_path):
    run = used_run(tmp_path, steps=1)
    assert sorted(p.name for p in run.path.iterdir()) == ["config.yaml", "metrics.jsonl"]


def threads_config(**cluster):
    return config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "loss": {"kl": {"coef": 0.01}},
                             "cluster": {"num_cpus": 4, "rollout": {"num_actors": 2, "num_cpus": 1.0},
                                         "learner": {"num_cpus": 1.0}, "reference": {"num_cpus": 0.5}, **cluster}})


def test_actor_threads_follow_reserved_cpus_unless_set():
    c = config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "loop": {"mode": "async", "max_staleness": 1},
                          "cluster": {"learner": {"num_cpus": 0.5, "num_threads": 2}, "rollout": {"num_cpus": 1.5},
                                      "actor_env": {"TOKENIZERS_PARALLELISM": "true"}}})
    assert actor_env("rollout", c)["OMP_NUM_THREADS"] == "2"  # 1.5 CPUs rounded up
    assert actor_env("reference", c)["OMP_NUM_THREADS"] == "1"  # fractional: one thread
    learner = actor_env("learner", c)
    assert learner["OMP_NUM_THREADS"] == "2" and learner["TOKENIZERS_PARALLELISM"] == "true"  # actor_env wins
    assert "MALLOC_MMAP_THRESHOLD_" not in learner


def test_sharded_learners_on_the_cpu_return_freed_large_blocks_to_the_system():
    tree = {"model": {"path": "m"}, "data": {"path": "d"}, "learner": {"strategy": "fsdp"}}
    assert actor_env("learner", config.from_dict(tree))["MALLOC_MMAP_THRESHOLD_"] == str(2**20)
    assert "MALLOC_MMAP_THRESHOLD_" not in actor_env("rollout", config.from_dict(tree))
    on_gpus = config.from_dict({**tree, "cluster": {"learner": {"num_gpus": 1}}})
    assert "MALLOC_MMAP_THRESHOLD_" not in actor_env("learner", on_gpus)



def test_a_role_granted_no_gpu_sees_none_and_one_granted_a_gpu_needs_cuda():
    c = config.from_dict({"model": {"path": "m"}, "data": {"path": "d"},
                          "cluster": {"learner": {"num_gpus": 1}}})
    # On a GPU node a GPU build of vLLM or torch would otherwise take GPU 0; Ray names the granted ones itself.
    assert actor_env("rollout", c)["CUDA_VISIBLE_DEVICES"] == ""
    assert "CUDA_VISIBLE_DEVICES" not in actor_env("learner", c)
    assert granted_device(0, "reference") == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match=r"the learner actor was granted 1 GPU \(cluster\.learner\.num_gpus\) "
                                               r"but CUDA does not work in its process .* set "
                                               r"cluster\.learner\.num_gpus to 0"):
            granted_device(1, "learner")


def test_synchronous_roles_take_turns_on_every_core_of_the_embedded_cluster(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    c = threads_config()  # old log-probs come from the update: the reference scores alone, then the learner trains
    assert [role_threads(role, c) for role in ("rollout", "reference", "learner")] == [2, 4, 4]
    overlapping = c.model_copy(update={"learner": c.learner.model_copy(update={"ppo_epochs": 2})})
    assert not overlapping.old_logprobs_in_update  # learners score old log-probs while the reference scores
    assert [role_threads(role, overlapping) for role in ("reference", "learner")] == [2, 2]
    assert role_threads("learner", threads_config(learner={"num_cpus": 1.0, "num_threads": 1})) == 1  # set wins
    assert role_threads("learner", threads_config(address="auto")) == 1  # joined cluster: node sizes unknown
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:6379")
    assert role_threads("learner", threads_config()) == 1


def segmented_batch() -> ScoredRollouts:
    """One prompt, two episodes: the first trained as three sequences (reward 1.0 on each), the second as one (0.0)."""
    rollouts = one_turn(prompt_ids=[[1]] * 4, response_ids=[[2, 3], [4], [5], [6, 7, 8]],
                        rollout_logprobs=[[0.0, 0.0], [0.0], [0.0], [0.0] * 3], response_texts=["a", "b", "c", "d"],
                        finish_reasons=["stop"] * 4, group=[0] * 4, policy_version=[0] * 4)
    episodes = [Episode(turns=3, tool_calls=2, env_wait_s=1.0, cut="max_turns", reward=1.0),
                Episode(turns=0, reward=1.0, segment=1), Episode(turns=0, reward=1.0, segment=2),
                Episode(turns=1, tool_calls=1, env_wait_s=3.0, reward=0.0)]
    return ScoredRollouts(replace(rollouts, episodes=episodes), [1.0, 1.0, 1.0, 0.0]).validate()


def test_reward_figures_are_means_over_episodes(tmp_path):
    run = RunDir(cfg(tmp_path))
    row = run.step_metrics(1, segmented_batch(), {}, None, {}, SimpleNamespace(dropped=0))
    run.close()
    # Episodes 1.0 and 0.0 (not rows 1, 1, 1, 0: mean 0.75).
    assert row["reward/mean"] == 0.5 and row["reward/std"] == 0.5


def test_agent_figures_count_each_episode_once():
    m = episode_metrics(segmented_batch().rollouts)
    assert m["agent/turns_mean"] == 2.0 and m["agent/turns_max"] == 3.0  # episodes of 3 and 1 turns
    assert m["agent/tool_calls"] == 3.0 and m["agent/env_wait_s"] == 2.0
    assert m["agent/cut_frac"] == 0.5 and m["agent/cut/max_turns"] == 1.0
    assert m["agent/sequences_per_episode"] == 2.0 and m["agent/non_continuations"] == 2.0


def test_an_environments_figures_are_means_over_the_episodes_that_report_them():
    batch = segmented_batch()
    episodes = list(batch.rollouts.episodes)
    episodes[0] = replace(episodes[0], metrics={"correct": 1.0, "calls": 2.0})
    episodes[1] = replace(episodes[1], metrics={"correct": 7.0})  # a later segment: its figures are its first's
    episodes[3] = replace(episodes[3], metrics={"correct": 0.0})
    m = episode_metrics(replace(batch.rollouts, episodes=episodes))
    # correct: episodes 1.0 and 0.0; calls: only the first episode reports it.
    assert (m["env/correct"], m["env/calls"]) == (0.5, 2.0)
    assert not any(k.startswith("env/") for k in episode_metrics(batch.rollouts))


def test_every_loss_figure_has_the_name_users_read():
    # Each figure compute_loss reports (any loss.policy.type) is renamed for metrics.jsonl and the dashboards, but the
    # loss terms, which keep their names.
    from distrl.algo.loss import MERGE
    from distrl.run_dir import RENAMES

    assert {key for key in MERGE if key not in RENAMES} == {"loss/policy", "loss/kl", "loss/entropy", "loss/total"}
    assert RENAMES["cov_frac"] == "policy/cov_frac" and RENAMES["seq_ratio_max"] == "policy/seq_ratio_max"
