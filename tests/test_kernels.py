"""`learner.kernels` on the CPU (`distrl.workers.training.kernels`): `plain` leaves the model as it is, fused kernels
are refused on the CPU naming the field, a missing liger-kernel names the extra to install, the decoder layers (the
units that are compiled and cast) are found, and a kernel library's patch of transformers' modules is confined to
the model it was applied to (with a fake of liger's patch: liger needs Triton). The kernels themselves run in the
GPU smoke suite (tests/gpu/test_gpu_kernels.py)."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch
from test_learner import batch

from distrl.config import ModelConfig
from distrl.workers.training.kernels import apply_kernels, confined, decoder_layers
from distrl.workers.training.model import load_causal_lm, response_logprobs


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


def fake_liger(model, rope_calls: list[int]) -> None:
    """What liger-kernel's `_apply_liger_kernel_to_instance` does to a Qwen2 model (liger needs Triton, which the
    CPU machines lack; the GPU smoke suite runs the real one): transformers' modelling module gets another rotary
    function and other RMSNorm and MLP classes, for every model built later, and the instance's own MLPs get a
    forward of their own. Here the rotary function counts its calls and computes as the original; the MLP forward
    is the class's own, bound on the instance."""
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    original = qwen2.apply_rotary_pos_emb

    def counted_rope(q, k, cos, sin, *args, **kwargs):
        rope_calls.append(1)
        return original(q, k, cos, sin, *args, **kwargs)

    qwen2.apply_rotary_pos_emb = counted_rope
    qwen2.Qwen2RMSNorm = type("FusedRMSNorm", (qwen2.Qwen2RMSNorm,), {})
    qwen2.Qwen2MLP = type("FusedMLP", (qwen2.Qwen2MLP,), {})
    for layer in model.model.layers:
        layer.mlp.forward = types.MethodType(type(layer.mlp).forward, layer.mlp)


def test_a_kernel_patch_is_confined_to_its_model(tiny_qwen2_dir):
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    module_before = dict(vars(qwen2))
    plain = load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "float32")
    patched = load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "float32")
    calls: list[int] = []
    replaced = confined(lambda: fake_liger(patched, calls), patched)
    # transformers' modelling module is as it was: every attribute the patch replaced is back
    assert replaced.keys() == {qwen2.__name__}
    assert sorted(replaced[qwen2.__name__]) == ["Qwen2MLP", "Qwen2RMSNorm", "apply_rotary_pos_emb"]
    assert all(vars(qwen2)[key] is value for key, value in module_before.items())
    # the patched model reads the replaced rotary function, once per layer (2 layers), through one shared copy of
    # the attention's forward; its MLPs keep the forward the patch gave them
    seqs = batch().sequences
    with torch.no_grad():
        patched_logprobs = response_logprobs(patched, seqs, 1.0)[0]
    assert len(calls) == 2
    attentions = [layer.self_attn for layer in patched.model.layers]
    assert attentions[0].forward.__func__ is attentions[1].forward.__func__
    assert attentions[0].forward.__func__ is not qwen2.Qwen2Attention.forward
    assert all("forward" in vars(layer.mlp) for layer in patched.model.layers)
    # a model built after it, and one built before, are plain: neither calls the replaced function
    after = load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "float32")
    assert type(after.model.norm) is qwen2.Qwen2RMSNorm and type(after.model.layers[0].mlp) is qwen2.Qwen2MLP
    with torch.no_grad():
        for model in (plain, after):
            torch.testing.assert_close(response_logprobs(model, seqs, 1.0)[0], patched_logprobs, rtol=0, atol=0)
    assert len(calls) == 2
    assert not any("forward" in vars(m) for m in (*plain.modules(), *after.modules()))


def test_a_patch_that_raises_still_leaves_the_module_as_it_was(tiny_qwen2_dir):
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    rope = qwen2.apply_rotary_pos_emb
    model = load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "float32")

    def failing() -> None:
        qwen2.apply_rotary_pos_emb = len
        raise RuntimeError("the kernel library failed halfway")

    with pytest.raises(RuntimeError, match="halfway"):
        confined(failing, model)
    assert qwen2.apply_rotary_pos_emb is rope
