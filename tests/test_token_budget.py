"""`max_tokens_per_micro_batch: auto` (`distrl.workers.training.token_budget`): the bytes a token costs, worked by hand
for Qwen2.5-0.5B's shape, and the budget from a GPU's free memory (its report faked on the CPU); 8192 on the CPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from distrl.workers.training import token_budget
from distrl.workers.training.token_budget import CPU_TOKENS, auto_token_budget, bytes_per_token

QWEN05 = SimpleNamespace(hidden_size=896, intermediate_size=4864, num_hidden_layers=24)


def test_bytes_per_token_by_hand():
    layer = (24 * 896 + 10 * 4864) * 1.25  # 70,144 bytes per layer x 1.25 = 87,680
    assert bytes_per_token(QWEN05, training=True, checkpointing=False) == pytest.approx(24 * layer)  # 2.10 MB
    assert bytes_per_token(QWEN05, training=True, checkpointing=True) == pytest.approx(24 * 2 * 896 + layer)
    assert bytes_per_token(QWEN05, training=False, checkpointing=False) == pytest.approx(2 * layer)


class Model(torch.nn.Module):
    def __init__(self, params: int):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(params))
        self.config = QWEN05


def test_the_budget_is_the_free_memory_left_over_per_token(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (40 * gib, 80 * gib))
    # 1e6 parameters: 12 + 2 bytes each = 14 MB planned; margin 0.08 x 80 GiB + 2 GiB = 8.4 GiB.
    free = 40 * gib - 14e6 - (0.08 * 80 * gib + 2 * gib)
    expected = int(free / bytes_per_token(QWEN05, True, False))
    # (40 - 8.4) GiB - 14 MB = 33.92e9 bytes over 24 x 87,680 = 2.104e6 bytes a token: 16,117 tokens.
    assert auto_token_budget(Model(10**6), "cuda", training=True) == expected == 16_117
    assert auto_token_budget(Model(10**6), "cuda", training=False) == token_budget.MAX_TOKENS  # capped
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (9 * gib, 80 * gib))
    with pytest.raises(ValueError, match=r"critic.max_tokens_per_micro_batch 'auto'.*fewer than 512 tokens"):
        auto_token_budget(Model(10**6), "cuda", training=True, field="critic.max_tokens_per_micro_batch")


def test_on_the_cpu_auto_is_a_fixed_budget():
    assert auto_token_budget(Model(10), "cpu", training=True) == CPU_TOKENS == 8192


def test_memory_that_other_parts_will_take_is_left_out(monkeypatch):
    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (12 * gib, 80 * gib))
    # Scoring (no gradients): 1e6 parameters' bf16 casts, 2 MB; margin 8.4 GiB; 2 x 87,680 = 175,360 bytes a token.
    # (12 - 8.4) GiB - 2 MB = 3.8635e9 bytes: 22,031 tokens; with 2 GiB reserved (a hybrid learner's AdamW
    # moments), 1.6 GiB - 2 MB = 1.7160e9 bytes: 9,785 tokens.
    assert auto_token_budget(Model(10**6), "cuda", training=False) == 22_031
    assert auto_token_budget(Model(10**6), "cuda", training=False, reserved=2 * gib) == 9_785
    # 3.58 GiB reserved leaves 0.02 GiB - 2 MB, room for 111 tokens
    with pytest.raises(ValueError, match=r"the other parts on the device 3.6 GiB.*fewer than 512 tokens"):
        auto_token_budget(Model(10**6), "cuda", training=False, reserved=3.58 * gib)


def test_learners_sharing_a_micro_batch_hold_a_slice_of_its_tokens_each(monkeypatch):
    # learner.sequence_parallel_size 2: each learner holds half of a micro-batch's tokens, so the micro-batch may
    # have twice one learner's budget (16,117 tokens as above: 32,234), on the CPU too (2 x 8192).
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (40 * 2**30, 80 * 2**30))
    assert auto_token_budget(Model(10**6), "cuda", training=True, sequence_parallel=2) == 2 * 16_117 == 32_234
    assert auto_token_budget(Model(10), "cpu", training=True, sequence_parallel=2) == 16_384
