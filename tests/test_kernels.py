"""`learner.kernels` on the CPU (`distrl.workers.kernels`): `plain` leaves the model as it is, fused kernels are
refused on the CPU naming the field, a missing liger-kernel names the extra to install, and the decoder layers (the
units that are compiled and cast) are found. The kernels themselves run in the GPU smoke suite
(tests/gpu/test_gpu_kernels.py)."""

from __future__ import annotations

import importlib.util

import pytest

from distrl.config import ModelConfig
from distrl.workers.kernels import apply_kernels, decoder_layers
from distrl.workers.model import load_causal_lm


def test_plain_is_the_model_itself_and_fused_kernels_need_a_gpu(tiny_model_dir):
    model = load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32")
    assert apply_kernels(model, "plain", "cpu", "learner.kernels") is model
    for kernels in ("liger", "compile"):
        with pytest.raises(ValueError, match=f"critic.kernels '{kernels}' needs a GPU"):
            apply_kernels(model, kernels, "cpu", "critic.kernels")
    assert len(decoder_layers(model)) == model.config.num_hidden_layers == 2


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed here")
def test_liger_without_the_package_names_the_extra(tiny_model_dir):
    model = load_causal_lm(ModelConfig(path=str(tiny_model_dir)), "float32")
    with pytest.raises(ValueError, match=r"reference.kernels 'liger' needs liger-kernel.*distrl\[kernels\]"):
        apply_kernels(model, "liger", "cuda", "reference.kernels")
