"""Mixed precision by casting once per forward pass (`distrl.workers.training.mixed_precision`), on the CPU in bfloat16:
the pass equals a bfloat16 copy of the model's, every weight is cast once (the tied embedding and head once for both),
gradients reach the float32 masters as the copy's gradients, the masters stay float32 parameters, and gradient
checkpointing (which recomputes layers) gives the same gradients."""

from __future__ import annotations

import copy

import torch
from test_packing import BATCH, ragged

from distrl.config import ModelConfig
from distrl.workers.training.mixed_precision import CastOncePerForward
from distrl.workers.training.model import load_causal_lm, response_logprobs


def loss_and_grads(model, seqs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logprobs, _ = response_logprobs(model, seqs, 0.8)
    loss = (logprobs * seqs.response_mask).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def test_the_pass_is_a_bfloat16_copys_and_gradients_reach_the_float32_masters(tiny_qwen2_dir):
    master = load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "float32").train()
    half = copy.deepcopy(master).to(torch.bfloat16)
    for name, buffer in master.named_buffers():  # buffers (rotary frequencies) are no weights: float32 in both
        half.get_submodule(name.rpartition(".")[0]).register_buffer(name.rpartition(".")[2], buffer.clone(),
                                                                     persistent=False)
    hooks = CastOncePerForward(master, torch.bfloat16)
    seqs = ragged(*BATCH)
    loss, grads = loss_and_grads(master, seqs)
    loss_half, grads_half = loss_and_grads(half, seqs)
    assert torch.equal(loss, loss_half)  # the same bfloat16 arithmetic
    assert grads.keys() == grads_half.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_half[name], rtol=0, atol=0, msg=name)
    for param in master.parameters():  # restored after the pass, gradients in float32
        assert type(param) is torch.nn.Parameter and param.dtype == param.grad.dtype == torch.float32
    hooks.remove()
    assert response_logprobs(master, seqs, 0.8)[0].dtype == torch.float32


def test_each_weight_is_cast_once_per_forward_pass(tiny_qwen2_dir):
    model = load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "float32")
    CastOncePerForward(model, torch.bfloat16)
    params = {id(p) for p in model.parameters()}  # the tied embedding and head counted once
    casts: list[int] = []

    class Watch(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.to and id(args[0]) in params:
                casts.append(id(args[0]))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), Watch():
        response_logprobs(model, ragged(*BATCH), 1.0)
    assert sorted(casts) == sorted(params)


def test_gradient_checkpointing_recasts_and_gives_the_same_gradients(tiny_qwen2_dir):
    results = []
    for checkpointing in (False, True):
        model = load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "float32").train()
        if checkpointing:
            model.gradient_checkpointing_enable()
        CastOncePerForward(model, torch.bfloat16)
        results.append(loss_and_grads(model, ragged(*BATCH)))
    (loss, grads), (loss_ckpt, grads_ckpt) = results
    assert torch.equal(loss, loss_ckpt)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[name], grad, rtol=0, atol=0, msg=name)
