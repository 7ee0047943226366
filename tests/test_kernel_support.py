"""The preflight's check of `kernels: liger` (`distrl.workers.training.kernel_support`), on the CPU without
liger-kernel: a liger-kernel stand-in (a package whose monkey_patch.py holds liger's table of model types, as
liger-kernel 0.8.5 does) on sys.path, or none at all. A `liger` the config asked for is refused with the reason; one
that came from the GPU default falls back to `plain` with a note."""

from __future__ import annotations

import importlib

import pytest

from distrl import config
from distrl.workers.training import kernel_support
from distrl.workers.training.kernel_support import check_liger, liger_model_types, liger_problem

GPU_LEARNER = {"model": {"path": "m"}, "data": {"path": "d.jsonl"}, "cluster": {"learner": {"num_gpus": 1}}}


@pytest.fixture
def fake_liger(tmp_path, monkeypatch):
    """A liger_kernel package that patches llama models only (its __init__ would fail if imported: the check must
    read its table, not import it)."""
    package = tmp_path / "site" / "liger_kernel"
    (package / "transformers").mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('liger_kernel must not be imported by the check')\n")
    (package / "transformers" / "monkey_patch.py").write_text(
        "def apply_liger_kernel_to_llama(model=None):\n    pass\n\n"
        "MODEL_TYPE_TO_APPLY_LIGER_FN = {\n    \"llama\": apply_liger_kernel_to_llama,\n}\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    importlib.invalidate_caches()


@pytest.fixture
def no_liger(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(kernel_support.importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real(name, *a))


def test_the_table_is_read_from_the_source(fake_liger):
    assert liger_model_types() == frozenset({"llama"})


def test_the_model_type_comes_from_its_config(fake_liger, tiny_model_dir, tiny_qwen2_dir):
    assert liger_problem(str(tiny_model_dir)) is None  # llama
    assert liger_problem(None) is None  # not built yet: only the package is checked
    assert "no kernels for the model's type 'qwen2'" in liger_problem(str(tiny_qwen2_dir))


def test_liger_the_config_asked_for_is_refused_and_the_gpu_default_falls_back(no_liger, tiny_model_dir, capsys):
    asked = config.from_dict({**GPU_LEARNER, "learner": {"kernels": "liger"}})
    problems = check_liger(asked, lambda path: str(tiny_model_dir))
    assert problems == ["learner.kernels 'liger': liger-kernel is not installed here (distrl's `kernels` extra: pip "
                        "install 'distrl[kernels]'); set learner.kernels: plain or compile"]
    assert asked.learner.kernels == "liger"
    defaulted = config.from_dict(GPU_LEARNER)
    assert defaulted.learner.kernels == "liger" and "kernels" not in defaulted.learner.model_fields_set
    assert check_liger(defaulted, lambda path: str(tiny_model_dir)) == []
    assert defaulted.learner.kernels == "plain"
    assert "learner.kernels: plain, not the GPU default liger: liger-kernel is not installed" in capsys.readouterr().out
    assert "kernels: plain" in config.to_yaml(defaulted)  # what the run's config.yaml then holds


def test_each_role_is_checked_against_its_own_model(fake_liger, tiny_model_dir, tiny_qwen2_dir, capsys):
    """The policy is a llama (liger patches it), the reference a qwen2 (it does not): only the reference falls
    back."""
    cfg = config.from_dict({**GPU_LEARNER, "model": {"path": str(tiny_model_dir)}, "loss": {"kl": {"coef": 0.01}},
                            "reference": {"path": str(tiny_qwen2_dir)}})
    assert check_liger(cfg, lambda path: path) == []
    assert (cfg.learner.kernels, cfg.reference.kernels) == ("liger", "plain")
    assert "reference.kernels: plain, not the GPU default liger: liger-kernel has no kernels" in capsys.readouterr().out


def test_the_preflight_falls_back_or_refuses_before_anything_starts(no_liger, tiny_model_dir, toy_dataset, tmp_path,
                                                                     capsys):
    from test_preflight import make_cfg

    from distrl.preflight import PreflightError, check

    on_gpus = {"address": "127.0.0.1:6379", "learner": {"num_gpus": 1}, "rollout": {"num_gpus": 1}}  # no GPU here
    cfg = make_cfg(tiny_model_dir, toy_dataset, tmp_path, cluster=on_gpus)
    check(cfg)
    assert cfg.learner.kernels == "plain" and "learner.kernels: plain" in capsys.readouterr().out
    asked = make_cfg(tiny_model_dir, toy_dataset, tmp_path, cluster=on_gpus, learner={"kernels": "liger"})
    with pytest.raises(PreflightError, match=r"learner.kernels 'liger': liger-kernel is not installed"):
        check(asked)
