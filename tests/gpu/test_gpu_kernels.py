"""The learner's GPU paths of issue 29 on CUDA in bfloat16: the chunked LM head against the plain one (values and
gradients), liger-kernel's and torch.compile's kernels against the plain model (log-probs and a training step), the
automatic token budget, and the host's waits in one update (CUDA's own count of synchronising calls). Liger rows
skip where liger-kernel is not installed (carry its wheel: docs/BENCHMARKS.md), saying so."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from test_gpu_attention import assert_near
from test_gpu_workers import BF16_LOGPROB_ATOL, assert_trains, make_learner
from test_learner import batch

from distrl.algo import linear_logprobs, token_logprobs
from distrl.algo.logprobs import entropy_from_logits
from distrl.workers.token_budget import MAX_TOKENS, MIN_TOKENS


def test_the_chunked_head_equals_the_plain_head_on_cuda():
    g = torch.Generator(device="cuda").manual_seed(0)
    k, h, v = 1000, 256, 32000
    hidden = (torch.randn(k, h, device="cuda", generator=g) / 4).bfloat16().requires_grad_()
    weight = (torch.randn(v, h, device="cuda", generator=g) / 16).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (k,), device="cuda", generator=g)
    lp, ent = linear_logprobs(hidden, weight, targets, 0.9, with_entropy=True, chunk_size=300)
    grads = torch.autograd.grad(lp.sum() + ent.sum(), (hidden, weight))
    logits = hidden @ weight.T  # the plain path: [K, V] logits in bfloat16, then the chunked log-softmax
    lp0, ent0 = token_logprobs(logits, targets, 0.9), entropy_from_logits(logits, 0.9)
    grads0 = torch.autograd.grad(lp0.sum() + ent0.sum(), (hidden, weight))
    assert_near(lp, lp0, "log-probs", 1e-3)
    assert_near(ent, ent0, "entropies", 1e-3)
    for name, a, b in zip(("hidden", "weight"), grads, grads0, strict=True):
        assert_near(a, b, f"gradient of the {name}")


def kernels_or_skip(kernels: str) -> None:
    if kernels == "liger":
        pytest.importorskip("liger_kernel.transformers", reason="liger-kernel is not installed on this machine")


@pytest.mark.parametrize("kernels", ["liger", "compile"])
def test_fused_kernels_give_the_plain_log_probs_and_train(tiny_qwen2_dir, kernels):
    kernels_or_skip(kernels)
    plain, fused = make_learner(tiny_qwen2_dir), make_learner(tiny_qwen2_dir, kernels=kernels)
    seqs = batch().sequences
    torch.testing.assert_close(fused.logprobs(seqs), plain.logprobs(seqs), rtol=0, atol=BF16_LOGPROB_ATOL)
    assert_trains(fused)


def test_the_automatic_token_budget_follows_the_free_memory(tiny_qwen2_dir):
    learner = make_learner(tiny_qwen2_dir, max_tokens_per_micro_batch="auto")
    assert MIN_TOKENS <= learner.trainer.token_budget <= MAX_TOKENS
    assert_trains(learner)


def test_one_update_of_four_micro_batches_synchronises_at_most_ten_times(tiny_qwen2_dir):
    learner = make_learner(tiny_qwen2_dir, micro_batch_size=2)
    data = replace(batch(), old_logprobs=learner.logprobs(batch().sequences))
    learner.update(data)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            learner.update(data)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchronizing" in str(w.message)]
    assert len(learner.trainer.micro_rows) == 4
    assert len(syncs) <= 10, syncs
