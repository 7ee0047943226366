"""The learner's GPU paths of issue 29 on CUDA in bfloat16: the chunked LM head against the plain one (values and
gradients), liger-kernel's and torch.compile's kernels against the plain model (the learner's, the reference's and
the critic's log-probs or values and a training step), liger's patch confined to its model, the automatic and a
fixed token budget, and the host's waits in one update (CUDA's own count of synchronising calls). Liger rows skip
where liger-kernel is not installed (carry its wheel: docs/BENCHMARKS.md), saying so."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from test_critic import batch as critic_batch
from test_gpu_attention import assert_near
from test_gpu_workers import BF16_LOGPROB_ATOL, assert_trains, make_learner
from test_learner import batch

from distrl.algo import linear_logprobs, token_logprobs
from distrl.algo.logprobs import entropy_from_logits
from distrl.config import CriticConfig, ModelConfig, ReferenceConfig
from distrl.merging import values
from distrl.workers.training.critic import Critic
from distrl.workers.training.reference import ReferenceWorker
from distrl.workers.training.token_budget import MAX_TOKENS, MIN_TOKENS


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


@pytest.mark.parametrize("kernels", ["liger", "compile"])
def test_the_reference_and_the_critic_take_fused_kernels(tiny_qwen2_dir, kernels):
    """Their GPU default (`liger`) and `compile`: the reference's log-probs as the plain reference's, and a critic
    that fits the returns."""
    kernels_or_skip(kernels)
    model = ModelConfig(path=str(tiny_qwen2_dir))
    plain, fused = (ReferenceWorker(ReferenceConfig(dtype="bfloat16", kernels=k), model, 1.0, num_gpus=1)
                    for k in ("plain", kernels))
    seqs = batch().sequences
    torch.testing.assert_close(fused.logprobs(seqs), plain.logprobs(seqs), rtol=0, atol=BF16_LOGPROB_ATOL)
    critic = Critic(model, CriticConfig(lr=1e-3, micro_batch_size=4, dtype="bfloat16", kernels=kernels,
                                        max_grad_norm=None, value_clip=None),
                    mini_batch_size=8, total_optimizer_steps=20, seed=0, num_gpus=1)
    data = critic_batch()
    losses = [values(critic.update(replace(data, old_values=critic.values(data.sequences))))["critic/value_loss"]
              for _ in range(10)]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < 0.5 * losses[0], losses


def test_a_plain_model_built_after_a_liger_one_stays_plain(tiny_qwen2_dir):
    """liger's patch of transformers' modelling module is confined to its model (`kernels.confined`): the module's
    attributes are as before, and a plain learner built after it computes as one built before."""
    kernels_or_skip("liger")
    from transformers.models.qwen2 import modeling_qwen2

    before = dict(vars(modeling_qwen2))
    plain_first = make_learner(tiny_qwen2_dir)
    fused = make_learner(tiny_qwen2_dir, kernels="liger")
    assert all(vars(modeling_qwen2)[key] is value for key, value in before.items())
    assert any("forward" in vars(m) for m in fused.model.modules())  # liger's, on the instance
    plain_after = make_learner(tiny_qwen2_dir)
    assert not any("forward" in vars(m) for m in plain_after.model.modules())
    seqs = batch().sequences
    torch.testing.assert_close(plain_after.logprobs(seqs), plain_first.logprobs(seqs), rtol=0, atol=1e-6)


def test_a_fixed_token_budget_on_cuda(tiny_qwen2_dir):
    """A budget of 20 tokens over test_learner's rows (8, 8, 10, 10, 8, 8, 8, 8 real tokens): 4 micro-batches of at
    most 20 tokens (first-fit decreasing: 10+8, 10+8, 8+8, 8+8), balanced; the learner trains."""
    learner = make_learner(tiny_qwen2_dir, max_tokens_per_micro_batch=20)
    assert learner.trainer.token_budget == 20
    assert_trains(learner)
    assert len(learner.trainer.micro_rows) == 4


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
