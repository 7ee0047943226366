"""Packed attention on CUDA in bfloat16: the varlen path (one FlashAttention call per layer) against the per-sequence
loop, forward and gradients; packed log-probs against the padded forward pass; gradient checkpointing on and off.

Tolerances: the two attention paths use different kernels (FlashAttention varlen against sdpa's flash or efficient
kernel per sequence), so in bfloat16 their outputs differ by rounding, ~1e-2 relative; the tests ask for 2e-2 of
each tensor's norm, far below the O(1) error of a wrong causal mask, sequence boundary or head grouping."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_learner import batch

from distrl.workers.training import packed_attention
from distrl.workers.training.model import padded_response_logprobs, response_logprobs
from distrl.workers.training.packed_attention import Pack, attention_path, looped_packed, varlen_packed
from distrl.workers.training.trainer import Counts

RELATIVE = 2e-2


def assert_near(a: torch.Tensor, b: torch.Tensor, what: str, relative: float = RELATIVE) -> None:
    """`a` within `relative` of `b`, measured as the norm of the difference over the norm of `b`."""
    error = float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-12))
    assert error < relative, f"{what}: relative error {error:.3g} >= {relative}"


@pytest.mark.parametrize("kv_heads", [8, 2])  # 2: grouped-query attention, as Qwen2.5 (14:2)
def test_varlen_agrees_with_the_loop_forward_and_backward(kv_heads):
    if not packed_attention.varlen_available():
        pytest.skip(f"torch {torch.__version__} has no varlen_attn with window_size and enable_gqa (torch 2.13 has)")
    assert attention_path("cuda", torch.bfloat16, 64) == "varlen"
    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = [37, 1, 200, 64, 5, 130]
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    n = positions.shape[1]
    q = torch.randn(1, 8, n, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(1, kv_heads, n, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
            for _ in range(2))
    pack = Pack.of(positions)
    assert pack.cu_seqlens.tolist() == [0, 37, 38, 238, 302, 307, 437] and pack.longest == 200
    module = torch.nn.Module()
    module.num_key_value_groups = 8 // kv_heads
    loop = looped_packed(module, q, k, v, pack, scaling=0.125)
    varlen = varlen_packed(q, k, v, pack, scale=0.125)
    assert_near(varlen, loop, "attention output")
    grad = torch.randn(loop.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    for name, a, b in zip("qkv", torch.autograd.grad(varlen, (q, k, v), grad),
                          torch.autograd.grad(loop, (q, k, v), grad), strict=True):
        assert_near(a, b, f"gradient of {name}")


def test_packed_logprobs_equal_padded_on_cuda(tiny_qwen2_dir):
    from distrl.config import ModelConfig
    from distrl.workers.training.model import load_causal_lm

    model = load_causal_lm(ModelConfig(path=str(tiny_qwen2_dir)), "bfloat16", device="cuda")
    seqs = batch().sequences.to("cuda")
    with torch.no_grad():
        packed = response_logprobs(model, seqs, 1.0)[0]
        padded = padded_response_logprobs(model, seqs, 1.0)[0] * seqs.response_mask
    assert_near(packed, padded, "packed against padded log-probs")


def test_gradient_checkpointing_gives_the_same_loss_and_gradients_on_cuda(tiny_qwen2_dir):
    from test_gpu_workers import make_learner

    results = []
    for checkpointing in (True, False):
        learner = make_learner(tiny_qwen2_dir, gradient_checkpointing=checkpointing)
        assert learner.model.is_gradient_checkpointing is checkpointing
        data = replace(batch(), old_logprobs=learner.logprobs(batch().sequences)).to("cuda")
        mask = data.response_mask
        loss, _ = learner._policy_loss(learner.model, data, Counts(float(mask.sum()), float((mask.sum(-1) > 0).sum())))
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in learner.model.named_parameters()
                                              if p.grad is not None}))
    (loss_on, grads_on), (loss_off, grads_off) = results
    assert_near(loss_on, loss_off, "loss")
    for name, grad in grads_off.items():
        assert_near(grads_on[name], grad, f"gradient of {name}")
