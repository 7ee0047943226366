"""Defaults that depend on where a role runs (`distrl.config.gpu_defaults`): with GPUs, a KL term's reference goes on
the learners' GPUs, the learner, critic and reference compute in bfloat16 and the engines use CUDA graphs; on the
CPU nothing changes; a value the config sets is always kept; and the resolved config reloads as itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from distrl import config
from distrl.config.loading import to_yaml

ROOT = Path(__file__).parents[1]
MINIMAL = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}}
KL = {"loss": {"kl": {"coef": 0.01}}}
GPUS = {"cluster": {"rollout": {"num_gpus": 1}, "learner": {"num_gpus": 1}}}


def load(tmp_path, *sections: dict, overrides=()) -> config.Config:
    tree: dict = dict(MINIMAL)
    for section in sections:
        for key, value in section.items():
            tree[key] = {**tree.get(key, {}), **value}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return config.load(path, list(overrides))


def test_with_gpus_the_reference_joins_the_learners_on_gpus_in_bf16_and_engines_use_cuda_graphs(tmp_path):
    cfg = load(tmp_path, GPUS, KL)
    assert cfg.cluster.reference.num_gpus == 1
    assert (cfg.learner.dtype, cfg.reference.dtype) == ("bfloat16", "bfloat16")
    assert cfg.rollout.enforce_eager is False


def test_on_the_cpu_the_defaults_stay(tmp_path):
    cfg = load(tmp_path, KL)
    assert cfg.cluster.reference.num_gpus == 0
    assert (cfg.learner.dtype, cfg.reference.dtype) == ("float32", "float32")
    assert cfg.rollout.enforce_eager is True


def test_without_a_kl_term_no_reference_takes_a_gpu(tmp_path):
    cfg = load(tmp_path, GPUS)
    assert cfg.cluster.reference.num_gpus == 0 and cfg.reference.dtype == "float32"
    assert cfg.learner.dtype == "bfloat16"


def test_values_the_config_sets_are_kept(tmp_path):
    cfg = load(tmp_path, GPUS, KL, {"learner": {"dtype": "float32"}, "reference": {"dtype": "float32"},
                                    "rollout": {"enforce_eager": True},
                                    "cluster": {"reference": {"num_gpus": 0, "num_cpus": 4}}})
    assert cfg.cluster.reference.num_gpus == 0
    assert (cfg.learner.dtype, cfg.reference.dtype) == ("float32", "float32")
    assert cfg.rollout.enforce_eager is True


def test_the_critic_follows_its_own_gpus(tmp_path):
    gae = {"algorithm": {"advantage": "gae"}, "critic": {}}
    on_gpu = load(tmp_path, GPUS, gae, {"cluster": {"critic": {"num_gpus": 1}}})
    on_cpu = load(tmp_path, GPUS, gae)
    assert (on_gpu.critic.dtype, on_cpu.critic.dtype) == ("bfloat16", "float32")


def test_the_resolved_config_reloads_as_itself(tmp_path):
    cfg = load(tmp_path, GPUS, KL)
    path = tmp_path / "resolved.yaml"
    path.write_text(to_yaml(cfg))
    assert config.load(path) == cfg


def test_a_kl_term_on_the_gspo_config_puts_the_reference_on_a_gpu_in_bf16():
    """The review's case (N8): configs/gspo-icepop.yaml has no reference; a KL term no longer runs one on the CPU."""
    cfg = config.load(ROOT / "configs" / "gspo-icepop.yaml", ["loss.kl.coef=0.01"])
    assert cfg.cluster.reference.num_gpus == 1 and cfg.reference.dtype == "bfloat16"


@pytest.mark.parametrize("name", ["grpo-gsm8k.yaml", "grpo-math.yaml", "gspo-icepop.yaml", "dr-grpo-kl-reward.yaml"])
def test_the_shipped_gpu_configs_run_bf16_roles_and_cuda_graphs(name):
    cfg = config.load(ROOT / "configs" / name)
    assert cfg.learner.dtype == "bfloat16" and cfg.rollout.enforce_eager is False
    if cfg.needs_reference:
        assert cfg.cluster.reference.num_gpus > 0 and cfg.reference.dtype == "bfloat16"


@pytest.mark.parametrize("name", ["grpo-gsm8k.yaml", "grpo-math.yaml", "gspo-icepop.yaml", "dr-grpo-kl-reward.yaml"])
def test_the_shipped_gpu_configs_fill_micro_batches_by_the_automatic_token_budget(name):
    """None sets a micro_batch_size that would turn the GPU default (`auto`) off, for the learner or the reference."""
    cfg = config.load(ROOT / "configs" / name)
    roles = [cfg.learner, *([cfg.reference] if cfg.needs_reference else []), *([cfg.critic] if cfg.critic else [])]
    assert [role.max_tokens_per_micro_batch for role in roles] == ["auto"] * len(roles)
    assert not any("micro_batch_size" in role.model_fields_set for role in roles)


def test_in_hybrid_mode_the_engine_and_reference_follow_the_learners_devices():
    cfg = config.from_dict({"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "loss": {"kl": {"coef": 0.01}},
                            "cluster": {"colocate": "hybrid", "learner": {"num_gpus": 1}}})
    assert cfg.reference.dtype == "bfloat16" and cfg.rollout.enforce_eager is False
    assert cfg.cluster.reference.num_gpus == 0  # not placed: the hybrid actor hosts the reference


def test_with_gpus_roles_take_liger_kernels_and_an_automatic_token_budget(tmp_path):
    cfg = load(tmp_path, GPUS, KL)
    assert (cfg.learner.kernels, cfg.reference.kernels) == ("liger", "liger")
    assert cfg.learner.max_tokens_per_micro_batch == cfg.reference.max_tokens_per_micro_batch == "auto"
    # chosen by the defaults, not the config: the preflight may fall back from a defaulted liger (test_kernel_support)
    assert not {"kernels", "dtype", "max_tokens_per_micro_batch"} & cfg.learner.model_fields_set
    cpu = load(tmp_path, KL)
    assert (cpu.learner.kernels, cpu.reference.kernels) == ("plain", "plain")
    assert cpu.learner.max_tokens_per_micro_batch is None and cpu.reference.max_tokens_per_micro_batch is None


def test_a_config_that_sizes_its_micro_batches_keeps_them(tmp_path):
    cfg = load(tmp_path, GPUS, {"learner": {"micro_batch_size": 2, "kernels": "compile"}})
    assert cfg.learner.max_tokens_per_micro_batch is None and cfg.learner.kernels == "compile"
    cfg = load(tmp_path, GPUS, {"learner": {"max_tokens_per_micro_batch": 4096}})
    assert cfg.learner.max_tokens_per_micro_batch == 4096


def test_fused_kernels_on_a_cpu_role_are_refused_by_field(tmp_path):
    with pytest.raises(ValueError, match=r"learner.kernels 'liger' needs a GPU.*cluster.learner.num_gpus is 0"):
        load(tmp_path, {"learner": {"kernels": "liger"}})
    with pytest.raises(ValueError, match=r"max_tokens_per_micro_batch"):
        load(tmp_path, {"learner": {"max_tokens_per_micro_batch": "many"}})
