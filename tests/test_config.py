"""The config tree: every shipped config loads, every bad config is rejected with the field it concerns and where
it was set, overrides apply, and validation stays light (no torch / Ray / vLLM)."""

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from distrl import config
from distrl.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}


def write(tmp_path, tree) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = config.load(path)
    assert cfg.global_batch_size % cfg.mini_batch_size == 0


def test_defaults_and_derived_sizes(tmp_path):
    cfg = config.load(write(tmp_path, MINIMAL))
    assert cfg.global_batch_size == 8 * 4 and cfg.mini_batch_size == 32
    assert cfg.loss.correction is None and not cfg.needs_reference


@pytest.mark.parametrize("overrides,in_update", [
    ([], True),  # one mini-batch (the whole step), one epoch: the update's own forward pass gives them
    (["learner.mini_batch_size=16"], False),  # two optimizer steps: the second starts from moved weights
    (["learner.ppo_epochs=2"], False),
    (["loss.kl.coef=0.1", "loss.kl.target=reward"], False),  # the reward's KL needs them before advantages
    (["loss.kl.coef=0.1", "loss.kl.target=loss"], True),
    (["algorithm.old_logprobs=rollout"], False),  # bypass: vLLM's stand in
    (["loss.policy=clip_cov"], False),  # the covariance losses select tokens over the batch from them beforehand
    (["loss.policy=kl_cov"], False),
    (["loss.policy=cispo"], True),
])
def test_when_the_update_takes_old_logprobs_from_its_own_forward_pass(tmp_path, overrides, in_update):
    assert config.load(write(tmp_path, MINIMAL), overrides).old_logprobs_in_update is in_update


BAD = [
    # (overrides, text the error must contain)
    (["loss.correction.mode=tis", "loss.correction.low=2", "loss.correction.high=1"], "loss.correction.low"),
    (["loss.correction.low=-0.1"], "loss.correction.low"),
    (["loss.correction.mode=seq_mask_tis", "loss.correction.level=sequence"], "loss.correction.level"),
    (["loss.correction.mode=seq_mask_tis", "loss.correction.low=3"], "loss.correction.low"),
    (["loss.policy.dual_clip=1.0"], "loss.policy.dual_clip"),
    (["loss.policy=gspo", "loss.policy.aggregation=token_mean"], "loss.policy.aggregation"),
    (["loss.policy=gspo", "loss.policy.dual_clip=3"], "loss.policy.dual_clip"),
    (["loss.policy.aggregation=token_sum"], "loss.policy.aggregation"),
    (["loss.policy=grpo"], "loss.policy.type"),
    (["algorithm.advantage=reinforce_pp", "algorithm.whitening=true"], "algorithm.whitening"),
    (["algorithm.lambda=1.5"], "algorithm.lambda"),
    (["loss.kl.estimator=k4"], "loss.kl.estimator"),
    (["loss.kl.coef=-1"], "loss.kl.coef"),
    (["loss.kl.target=reward", "loss.kl.estimator=k3+", "loss.kl.coef=0.1"], "loss.kl.estimator"),
    (["loss.kl.target=penalty"], "loss.kl.target"),
    (["loss.policy.clip_low=1.5"], "loss.policy.clip_low"),
    (["loss.policy=gspo", "loss.policy.clip_low=1.5"], "loss.policy.clip_low"),
    (["learner.lr_schedule=linear"], "learner.lr_schedule.type"),
    (["learner.lr_schedule=cosine", "learner.lr_schedule.min_lr_ratio=2"], "learner.lr_schedule.min_lr_ratio"),
    (["learner.lr_schedule.min_lr_ratio=0.1"], "learner.lr_schedule.min_lr_ratio"),
    (["loop.max_staleness=2"], "loop.max_staleness"),
    (["algorithm.advantage=grpo", "rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt"),
    (["algorithm.advantage=rloo", "rollout.n_samples_per_prompt=1"], "rollout.n_samples_per_prompt"),
    (["algorithm.advantage=gae"], "critic"),
    (["critic.lr=1e-5"], "algorithm.advantage"),
    (["algorithm.advantage=gae", "critic.mini_batch_size=12"], "critic.mini_batch_size"),
    (["algorithm.advantage=gae", "critic.micro_batch_size=3"], "critic.micro_batch_size"),
    (["algorithm.advantage=gae", "critic.value_clip=0"], "critic.value_clip"),
    (["algorithm.advantage=gae", "critic.typo=1"], "critic.typo"),
    (["algorithm.advantage=gae", "critic.lr=1e-5", "cluster.backend=local", "cluster.critic.num_actors=2"],
     "cluster.critic.num_actors"),
    (["algorithm.advantage=ppo"], "algorithm.advantage"),
    (["learner.mini_batch_size=12"], "learner.mini_batch_size"),
    (["learner.micro_batch_size=3"], "learner.micro_batch_size"),
    (["learner.max_tokens_per_micro_batch=0"], "learner.max_tokens_per_micro_batch"),
    (["reference.max_tokens_per_micro_batch=-1"], "reference.max_tokens_per_micro_batch"),
    (["learner.max_tokens_per_micro_batch=512", "cluster.learner.num_actors=3"], "cluster.learner.num_actors"),
    (["cluster.learner.num_actors=3"], "cluster.learner.num_actors"),
    (["learner.sequence_parallel_size=2", "cluster.learner.num_actors=3"],
     "cluster.learner.num_actors (3) must be a multiple of learner.sequence_parallel_size (2)"),
    (["learner.sequence_parallel_size=2", "cluster.learner.num_actors=2", "cluster.backend=local"],
     "learner.sequence_parallel_size 2 splits each micro-batch over the learners' process group"),
    (["learner.sequence_parallel_size=2", "cluster.learner.num_actors=6", "learner.micro_batch_size=3"],
     "must be divisible by cluster.learner.num_actors / learner.sequence_parallel_size (3) x "
     "learner.micro_batch_size (3)"),
    (["critic.sequence_parallel_size=2", "algorithm.advantage=gae"],
     "cluster.critic.num_actors (1) must be a multiple of critic.sequence_parallel_size (2)"),
    (["reference.sequence_parallel_size=2", "loss.kl.coef=0.01", "cluster.backend=ray"],
     "cluster.reference.num_actors (1) must be a multiple of reference.sequence_parallel_size (2)"),
    (["reference.sequence_parallel_size=2", "loss.kl.coef=0.01", "cluster.reference.num_actors=2",
      "cluster.backend=local"],
     "reference.sequence_parallel_size 2 splits each micro-batch over the reference actors' process group"),
    (["reference.sequence_parallel_size=2", "loss.kl.coef=0.01", "learner.lora.rank=8", "cluster.backend=ray"],
     "reference.sequence_parallel_size 2 with learner.lora: the learners answer for the reference"),
    (["reference.sequence_parallel_size=2", "loss.kl.coef=0.01", "cluster.colocate=hybrid", "cluster.backend=ray"],
     "reference.sequence_parallel_size 2 with cluster.colocate 'hybrid'"),
    (["algorithm.old_logprobs=rollout", "loss.correction.mode=tis"], "algorithm.old_logprobs"),
    (["rollout.max_model_len=10"], "rollout.max_model_len"),
    (["rollout.sampling.temperature=0"], "rollout.sampling.temperature"),
    (["rollout.sampling.top_p=1.5"], "rollout.sampling.top_p"),
    (["cluster.weight_sync=nccl"], "cluster.weight_sync"),
    (["cluster.rollout.num_actors=0"], "cluster.rollout.num_actors"),
    (["run.name=has space"], "run.name"),
    (["run.name=.."], "run.name"),
    (["run.name=."], "run.name"),
    (["run.name=a/b"], "run.name"),
    (["run.name=/abs"], "run.name"),
    (["run.name=.hidden"], "run.name"),
    (["run.name=-x"], "run.name"),
    (["run.steps=0"], "run.steps"),
    (["model.typo=1"], "model.typo"),
    (["learner.dtype=float16"], "learner.dtype"),
    (["rollout.tensor_parallel_size=2", "cluster.rollout.num_gpus=1"],
     "cluster.rollout.num_gpus (1) must be rollout.tensor_parallel_size (2)"),
    (["rollout.tensor_parallel_size=2", "cluster.colocate=hybrid"],
     "rollout.tensor_parallel_size 2 with cluster.colocate 'hybrid'"),
    (["rollout.expert_parallel=true"], "rollout.expert_parallel spreads experts"),
    (["rollout.expert_parallel=true", "rollout.tensor_parallel_size=2"], "vLLM's CPU build crashes in its fused-MoE"),
    (["rollout.routing_replay=true"], "rollout.routing_replay with engines on the CPU (cluster.rollout.num_gpus 0): "
                                      "vLLM returns the routed experts only from its Model Runner V2, which needs "
                                      "Triton"),
    (["rollout.routing_replay=true", "cluster.rollout.num_gpus=1", "learner.sequence_parallel_size=2"],
     "rollout.routing_replay with learner.sequence_parallel_size 2"),
    (["rollout.routing_replay=true", "cluster.rollout.num_gpus=1", "loss.kl.coef=0.01",
      "reference.sequence_parallel_size=2", "cluster.reference.num_actors=2"],
     "rollout.routing_replay with reference.sequence_parallel_size 2"),
    (["algorithm.old_logprobs=rollout", "rollout.sampling.top_p=0.9"], "rollout.sampling.top_p"),
    (["cluster.num_cpus=2", "cluster.learner.num_cpus=1.5"], "cluster.learner.num_actors x num_cpus"),
    (["loss.kl.cof=0.1"], "loss.kl.cof"),
    (["run.keep_checkpoints=0"], "run.keep_checkpoints"),
    (["run.trackers=[tensorboard]"], "must list jsonl"),
    (["run.trackers=[jsonl, wandb, wandb]"], "run.trackers lists wandb more than once"),
    (["run.trackers=[jsonl, neptune]"], "run.trackers.1"),
    (["run.mlflow.experiment=x"], "run.mlflow is set but run.trackers does not list mlflow"),
    (["run.tensorboard=2"], "run.tensorboard must be true or false"),
    # B3: fractional GPUs in an NCCL group ("Duplicate GPU detected")
    (["cluster.learner.num_gpus=0.5", "cluster.rollout.num_gpus=1"],
     "cluster.learner.num_gpus (0.5) is a fraction of a GPU, and cluster.weight_sync is auto, which picks nccl"),
    (["cluster.learner.num_gpus=1", "cluster.rollout.num_gpus=1.5", "cluster.colocate=true"],
     "cluster.rollout.num_gpus (1.5) is a fraction of a GPU, and cluster.weight_sync is auto"),
    (["cluster.weight_sync=nccl", "cluster.learner.num_gpus=1", "cluster.rollout.num_gpus=0.25"],
     "cluster.rollout.num_gpus (0.25) is a fraction of a GPU, and cluster.weight_sync is nccl:"),
    (["cluster.weight_sync=object_store", "cluster.learner.num_actors=2", "cluster.learner.num_gpus=0.5"],
     "cluster.learner.num_gpus (0.5) is a fraction of a GPU with cluster.learner.num_actors = 2"),
]


@pytest.mark.parametrize("overrides,field", BAD, ids=[b[1] + ":" + ",".join(b[0]) for b in BAD])
def test_bad_config_names_the_field(tmp_path, overrides, field):
    with pytest.raises(ConfigError) as err:
        config.load(write(tmp_path, MINIMAL), overrides)
    assert field in str(err.value)
    # Every problem points at where it was set: the --set that introduced a value, or the file line.
    assert "--set" in str(err.value) or "c.yaml" in str(err.value)


def test_a_token_budget_frees_the_mini_batch_from_the_micro_batch_size(tmp_path):
    # Without a budget 3 rows per micro-batch do not divide the mini-batch; with one, micro_batch_size is unused.
    cfg = config.load(write(tmp_path, MINIMAL), ["learner.micro_batch_size=3",
                                                 "learner.max_tokens_per_micro_batch=1024"])
    assert cfg.learner.max_tokens_per_micro_batch == 1024 and cfg.reference.max_tokens_per_micro_batch is None


def test_error_points_at_file_and_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  path: m\ndata:\n  path: d\nloss:\n  policy:\n    dual_clip: 0.5\n")
    with pytest.raises(ConfigError, match=r"loss\.policy\.dual_clip: Input should be greater than 1 .*c\.yaml:7"):
        config.load(path)


def test_several_problems_are_all_reported(tmp_path):
    with pytest.raises(ConfigError) as err:
        config.load(write(tmp_path, MINIMAL), ["rollout.n_samples_per_prompt=1", "learner.micro_batch_size=3"])
    text = str(err.value)
    assert "2 problems" in text and "n_samples_per_prompt" in text and "micro_batch_size" in text


def test_overrides_parse_yaml_values_and_create_sections(tmp_path):
    cfg = config.load(write(tmp_path, MINIMAL), ["loss.kl.coef=0.05", "loss.correction.mode=icepop",
                                                 "rollout.sampling.stop=[a, b]", "loss.policy.dual_clip=null"])
    assert cfg.loss.kl.coef == 0.05 and cfg.loss.correction.mode == "icepop"
    assert cfg.rollout.sampling.stop == ["a", "b"] and cfg.loss.policy.dual_clip is None


def test_gae_with_a_critic_loads(tmp_path):
    cfg = config.load(write(tmp_path, MINIMAL), ["algorithm.advantage=gae", "algorithm.whitening=true",
                                                 "critic.lr=5e-5", "critic.mini_batch_size=16"])
    assert cfg.critic is not None and cfg.critic.path is None and cfg.critic.value_clip == 0.2
    assert cfg.critic.lr == 5e-5 and cfg.critic_mini_batch_size == 16 and cfg.mini_batch_size == 32


def test_gae_lambda_is_spelled_lambda(tmp_path):
    cfg = config.load(write(tmp_path, MINIMAL), ["algorithm.lambda=0.9", "algorithm.whitening=true"])
    assert cfg.algorithm.lam == 0.9 and cfg.algorithm.whitening
    assert "lambda: 0.9" in config.to_yaml(cfg)


@pytest.mark.parametrize("override", ["novalue", "=3", "model.path.x=1"])
def test_malformed_override(tmp_path, override):
    with pytest.raises(ConfigError, match="--set"):
        config.load(write(tmp_path, MINIMAL), [override])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        config.load(tmp_path / "nope.yaml")
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  path: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:\d+:\d+: not valid YAML"):
        config.load(path)


def test_run_tensorboard_is_read_as_adding_or_leaving_out_the_tensorboard_tracker(tmp_path):
    def run(*overrides):
        return config.load(write(tmp_path, MINIMAL), overrides).run

    assert (run().trackers, run().tensorboard) == (["jsonl", "tensorboard"], True)
    assert (run("run.tensorboard=false").trackers, run("run.tensorboard=false").tensorboard) == (["jsonl"], False)
    listed = run("run.trackers=[jsonl, tensorboard, mlflow]", "run.tensorboard=false")
    assert (listed.trackers, listed.tensorboard) == (["jsonl", "mlflow"], False)
    assert run("run.trackers=[jsonl, wandb]", "run.wandb.project=p", "run.tensorboard=true").trackers == [
        "jsonl", "wandb", "tensorboard"]
    resolved = config.to_yaml(config.load(write(tmp_path, MINIMAL), ["run.tensorboard=false"]))
    assert "trackers:\n  - jsonl\n" in resolved and "tensorboard" not in resolved  # one spelling in config.yaml


def test_resolved_config_round_trips(tmp_path):
    cfg = config.load(ROOT / "configs" / "quickstart.yaml")
    again = config.from_dict(yaml.safe_load(config.to_yaml(cfg)))
    assert again == cfg


def test_quickstart_scales_to_the_topologies_the_service_tests_run():
    # The end-to-end tests scale the quickstart with --set alone; each must fit its 2 CPUs.
    for rollout, learners in ((2, 1), (2, 2), (1, 2)):
        config.load(ROOT / "configs" / "quickstart.yaml", [
            f"cluster.rollout.num_actors={rollout}", f"cluster.learner.num_actors={learners}",
            "cluster.learner.num_cpus=0.25"])


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          check=False)


def test_config_algo_and_cli_import_neither_ray_nor_vllm():
    code = ("import sys, distrl.config, distrl.algo, distrl.cli, distrl.types.batches\n"
            "heavy = [m for m in ('ray', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr


def test_validate_imports_no_torch_and_reports_errors():
    code = ("import sys\nfrom distrl.cli import main\n"
            "rc = main(['validate', 'configs/quickstart.yaml', '--set', 'loss.policy.dual_clip=0.5'])\n"
            "assert rc == 2, rc\n"
            "heavy = [m for m in ('torch', 'ray', 'vllm', 'wandb', 'mlflow') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert "loss.policy.dual_clip: Input should be greater than 1" in result.stderr
    assert "--set loss.policy.dual_clip=0.5" in result.stderr


def test_a_validate_that_checks_everything_imports_no_ray(tmp_path):
    """The preflight's resource check counts this machine's CPUs itself (cluster.num_cpus unset), without Ray."""
    code = ("import sys\nfrom distrl.cli import main\n"
            f"rc = main(['validate', 'configs/quickstart.yaml', '--set', 'cluster.num_cpus=null', '--set', "
            f"'run.output_dir={tmp_path}'])\n"
            "assert rc == 0, rc\n"
            "heavy = [m for m in ('ray', 'vllm') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    result = _run(code)
    assert result.returncode == 0, result.stderr


def test_validate_prints_resolved_config():
    result = subprocess.run([sys.executable, "-m", "distrl.cli", "validate", "configs/quickstart.yaml",
                             "--set", "run.steps=3"], capture_output=True, text=True, cwd=ROOT, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["run"]["steps"] == 3


def test_dr_grpos_divisor_defaults_to_the_most_tokens_a_sample_can_train_on():
    base = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "rollout": {"sampling": {"max_new_tokens": 16}}}
    assert config.from_dict(base).norm_len == 16  # one turn
    env = {**base, "env": {"class": "tests.agent_envs:Chatter", "max_turns": 3}}
    assert config.from_dict(env).norm_len == 48  # three turns of 16
    assert config.from_dict({**env, "env": {**env["env"], "max_tokens": 40}}).norm_len == 40
    assert config.from_dict({**env, "loss": {"policy": {"norm_len": 7}}}).norm_len == 7


@pytest.mark.parametrize("overrides", [
    ["cluster.learner.num_gpus=0.5", "cluster.rollout.num_gpus=0.5", "cluster.weight_sync=object_store"],
    ["cluster.learner.num_gpus=1", "cluster.rollout.num_gpus=1", "cluster.colocate=true"],  # whole GPUs: not shared
    ["cluster.learner.num_gpus=0.5"],  # the engines on the CPU: weights go through the object store
    ["cluster.learner.num_gpus=1", "cluster.rollout.num_gpus=0.5", "cluster.backend=local"],  # no NCCL locally
    ["cluster.reference.num_gpus=0.5", "loss.kl.coef=0.1"],  # the reference is in no NCCL group
    ["cluster.learner.num_gpus=0.5", "cluster.rollout.num_gpus=0.5", "learner.lora.rank=8"],  # adapters: object store
], ids=",".join)
def test_fractional_gpus_outside_any_nccl_group_are_accepted(tmp_path, overrides):
    config.load(write(tmp_path, MINIMAL), overrides)


def test_the_fractional_gpu_check_of_the_weight_sync_keys_on_the_placement_modes(tmp_path):
    """Every `cluster.colocate` mode but `hybrid` (the engine inside the learner's actor, weights passed in memory:
    no NCCL world) is checked."""
    from distrl.config.gpus import gpu_sharing_problems

    cluster = config.load(write(tmp_path, MINIMAL), ["cluster.learner.num_gpus=1"]).cluster
    shared = cluster.model_copy(update={"rollout": cluster.rollout.model_copy(update={"num_gpus": 0.5})})
    assert gpu_sharing_problems(shared, critics=False, lora=False)
    assert gpu_sharing_problems(shared.model_copy(update={"colocate": "hybrid"}), critics=False, lora=False) == []
    assert gpu_sharing_problems(shared, critics=False, lora=True) == []  # adapters: the object store, no NCCL world


def test_a_role_given_more_gpus_than_it_uses_is_warned_about(tmp_path):
    with pytest.warns(UserWarning, match=r"cluster\.learner\.num_gpus is 2, but each learner actor computes on one "
                                         r"GPU \(cuda:0\): the other 1 per actor stay idle"):
        config.load(write(tmp_path, MINIMAL), ["cluster.learner.num_gpus=2", "cluster.rollout.num_gpus=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.load(write(tmp_path, MINIMAL), ["cluster.reference.num_gpus=4"])  # no KL term: no reference actor
        # Hybrid actors host the engine and the reference: cluster.rollout and cluster.reference hold nothing.
        config.load(write(tmp_path, MINIMAL), ["cluster.colocate=hybrid", "cluster.learner.num_gpus=1",
                                               "cluster.rollout.num_gpus=4", "cluster.reference.num_gpus=4",
                                               "loss.kl.coef=0.1"])


# -------------------------------------------------------------------------- where roles run (issue 28)
def test_roles_take_labels_resources_and_a_gpu_model_in_rays_terms():
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", [
        'cluster.rollout.labels={"pool": "inference", "zone": "in(a, b)"}', "cluster.learner.labels={pool: '!spot'}",
        'cluster.learner.resources={"learner_slot": 1}'])
    assert cfg.cluster.rollout.labels == {"pool": "inference", "zone": "in(a, b)"}
    assert cfg.cluster.learner.resources == {"learner_slot": 1.0} and cfg.cluster.learner.placed_by_node


@pytest.mark.parametrize("setting,message", [
    ('cluster.rollout.labels={"pool": "a b"}', "cluster.rollout.labels: label 'pool': 'a b' is not a Ray label "
                                               "selector value"),
    ('cluster.rollout.labels={"-pool": "a"}', "cluster.rollout.labels: label '-pool' is not a valid Ray label key"),
    ('cluster.learner.resources={"GPU": 1}', "cluster.learner.resources: 'GPU' is one of Ray's own resources"),
    ('cluster.learner.resources={"slot": 0}', "cluster.learner.resources: 'slot': 0 must be > 0"),
    ("cluster.rollout.accelerator_type=H100", "cluster.rollout: accelerator_type 'H100' names a GPU model, but "
                                              "num_gpus is 0"),
    ("cluster.rollout.max_actors=0", "cluster.rollout.max_actors"),
])
def test_placement_settings_that_ray_would_refuse_are_refused_by_field(setting, message):
    with pytest.raises(config.ConfigError) as err:
        config.load(ROOT / "configs" / "quickstart.yaml", [setting])
    assert message in str(err.value)


def test_engine_bounds_are_for_the_asynchronous_loop_with_engines_placed_alone():
    with pytest.raises(config.ConfigError) as err:
        config.load(ROOT / "configs" / "quickstart.yaml", ["cluster.rollout.max_actors=3", "cluster.colocate=pack"])
    assert "cluster.rollout.min_actors / max_actors (1..3, num_actors 1) need the asynchronous loop" in str(err.value)
    assert "with cluster.colocate 'pack': pack reserves every role's actors in one placement group" in str(err.value)
    with pytest.raises(config.ConfigError, match=r"min_actors \(2\) > num_actors \(1\)"):
        config.load(ROOT / "configs" / "quickstart.yaml", ["cluster.rollout.min_actors=2"])
    cfg = config.load(ROOT / "configs" / "quickstart.yaml", ["loop.mode=async", "cluster.rollout.num_actors=2",
                                                             "cluster.rollout.min_actors=1",
                                                             "cluster.rollout.max_actors=4"])
    assert cfg.cluster.rollout.elastic and (cfg.cluster.rollout.fewest, cfg.cluster.rollout.most) == (1, 4)
    assert not config.load(ROOT / "configs" / "quickstart.yaml", ["loop.mode=async"]).cluster.rollout.elastic


def test_hybrid_actors_are_placed_by_the_learners_settings():
    with pytest.raises(config.ConfigError) as err:
        config.load(ROOT / "configs" / "quickstart.yaml", ["cluster.colocate=hybrid",
                                                           "cluster.rollout.labels={pool: inference}"])
    assert "cluster.rollout.labels with cluster.colocate 'hybrid'" in str(err.value)


def test_data_is_a_path_or_a_function_that_makes_the_rows():
    base = {"model": {"path": "m"}}
    fn = {"function": "distrl.standards.reasoning_gym:rows", "kwargs": {"tasks": "leg_counting", "seed": 1}}
    assert config.from_dict({**base, "data": fn}).data.source == "distrl.standards.reasoning_gym:rows"
    for data, problem in [({}, "exactly one of data.path"), ({"path": "d", **fn}, "exactly one of data.path"),
                          ({"path": "d", "kwargs": {"a": 1}}, "data.kwargs are the arguments of data.function"),
                          ({**fn, "split": "test"}, "data.split is for data.path")]:
        with pytest.raises(ConfigError, match=problem):
            config.from_dict({**base, "data": data})
    held_out = {"name": "h", **fn}
    with pytest.raises(ConfigError, match=r"makes the training data .* give it its own kwargs \(another seed\)"):
        config.from_dict({**base, "data": fn, "eval": {"sets": [held_out]}})
    other_seed = {**held_out, "kwargs": {"tasks": "leg_counting", "seed": 2}}
    assert config.from_dict({**base, "data": fn, "eval": {"sets": [other_seed]}}).eval.sets[0].kwargs["seed"] == 2


def test_the_mixture_of_experts_configs_replay_routes_on_gpu_engines():
    small = config.load(ROOT / "configs" / "moe-qwen3-30b-a3b.yaml")
    big = config.load(ROOT / "configs" / "moe-qwen3-235b-a22b.yaml")
    assert small.rollout.routing_replay and big.rollout.routing_replay
    assert small.cluster.rollout.num_gpus == 1 and small.learner.strategy.type == "fsdp"
    # One node of 8 GPUs: 2 engines, 5 learners, the reference.
    roles = small.cluster.rollout, small.cluster.learner, small.cluster.reference
    assert sum(r.num_actors * r.num_gpus for r in roles) == 8
    # Nine: one engine over 8 GPUs with expert parallelism, 64 learners, no reference (no KL term).
    assert (big.rollout.tensor_parallel_size, big.rollout.expert_parallel) == (8, True)
    assert big.cluster.learner.num_actors == 64
    assert not big.needs_reference


def test_partial_rollouts_are_an_async_loop_setting_for_one_turn_samples():
    base = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
    cfg = config.from_dict({**base, "loop": {"mode": "async", "partial_rollouts": True, "slice_tokens": 32}})
    assert cfg.slice_tokens == 32
    assert config.from_dict({**base, "loop": "async"}).slice_tokens is None  # off by default
    with pytest.raises(ConfigError, match=r"loop.partial_rollouts needs loop.mode 'async'"):
        config.from_dict({**base, "loop": {"mode": "sync", "partial_rollouts": True}})
    with pytest.raises(ConfigError, match=r"loop.slice_tokens: Input should be greater than or equal to 1"):
        config.from_dict({**base, "loop": {"mode": "async", "partial_rollouts": True, "slice_tokens": 0}})
    partial = {"mode": "async", "partial_rollouts": True}
    with pytest.raises(ConfigError, match=r"loop.partial_rollouts continues one-turn samples; env is set"):
        config.from_dict({**base, "loop": partial, "env": {"class": "tests.agent_envs:Chatter"}})
    with pytest.raises(ConfigError, match=r"loop.partial_rollouts with rollout.sampling.stop"):
        config.from_dict({**base, "loop": partial, "rollout": {"sampling": {"stop": ["\n"]}}})
    with pytest.raises(ConfigError, match=r"loop.partial_rollouts with rollout.routing_replay"):
        config.from_dict({**base, "loop": partial, "rollout": {"routing_replay": True},
                          "cluster": {"rollout": {"num_gpus": 1}}})
