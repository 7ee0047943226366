"""Which path packed attention takes (`attention_path`: varlen on CUDA in bf16/fp16 where torch has the API, the
loop over sequence lengths elsewhere), the varlen layout found from the position restarts (`Pack.cu_seqlens`), the
loop's stacks of equal-length sequences, and both paths' reshaping and GQA checked on the CPU against each other,
the varlen one through a stand-in for `varlen_attn` that computes what torch documents it to compute: sdpa on each
sequence alone. tests/gpu/test_packed_attention.py runs the real kernel on CUDA."""

from __future__ import annotations

import itertools

import pytest
import torch

from distrl.workers.training import packed_attention
from distrl.workers.training.packed_attention import Pack, attention_path, looped_packed, varlen_packed


def test_the_pack_gives_flash_attentions_cumulative_starts_over_the_flattened_rows():
    pack = Pack.of(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    assert pack.bounds == [[(0, 3), (3, 5), (5, 6)]]
    assert pack.cu_seqlens.tolist() == [0, 3, 5, 6] and pack.cu_seqlens.dtype == torch.int32
    assert pack.longest == 3
    two_rows = Pack.of(torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]))  # row 1 starts at token 4 of the flattened rows
    assert two_rows.cu_seqlens.tolist() == [0, 2, 4, 8] and two_rows.longest == 4


def test_the_loop_stacks_the_sequences_of_one_length():
    # Sequences [0, 3), [3, 5), [5, 8): lengths 3, 2, 3. Length 2: tokens 3, 4; length 3: tokens 0-2, then 5-7.
    # Concatenated: 3 4 0 1 2 5 6 7, so token 0 is at place 2, token 3 at place 0 (restore inverts the order).
    stacks = Pack.of(torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])).stacks(rows=1)
    assert stacks.lengths == [2, 3]
    assert [i.tolist() for i in stacks.index] == [[3, 4], [0, 1, 2, 5, 6, 7]]
    assert stacks.restore.tolist() == [2, 3, 4, 0, 1, 5, 6, 7]
    shared = Pack.of(torch.tensor([[0, 1, 0]])).stacks(rows=2)  # one row of positions for two rows of queries
    assert [i.tolist() for i in shared.index] == [[2, 5], [0, 1, 3, 4]]


def test_the_loop_makes_one_sdpa_call_per_sequence_length(monkeypatch):
    calls = []
    sdpa = packed_attention.sdpa_attention_forward

    def counting_sdpa(module, query, *args, **kwargs):
        calls.append(tuple(query.shape))
        return sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(packed_attention, "sdpa_attention_forward", counting_sdpa)
    q = k = v = torch.randn(1, 2, 11, 8)
    module = torch.nn.Module()
    looped_packed(module, q, k, v, Pack.of(torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 1]])), scaling=0.3)
    assert calls == [(2, 2, 2, 8), (1, 2, 3, 8), (1, 2, 4, 8)]  # [k sequences, heads, length, head size]


@pytest.mark.parametrize(("device", "dtype", "head_dim", "dropout", "path"), [
    ("cuda", torch.bfloat16, 64, 0.0, "varlen"),
    ("cuda", torch.float16, 128, 0.0, "varlen"),
    ("cuda", torch.float32, 64, 0.0, "loop"),   # FlashAttention has no float32
    ("cpu", torch.bfloat16, 64, 0.0, "loop"),   # nor a CPU kernel
    ("cuda", torch.bfloat16, 64, 0.1, "loop"),  # varlen_attn has no dropout
    ("cuda", torch.bfloat16, 60, 0.0, "loop"),  # head sizes are multiples of 8
    ("cuda", torch.bfloat16, 512, 0.0, "loop"),  # up to 256
])
def test_varlen_is_chosen_on_cuda_in_half_precision_only(device, dtype, head_dim, dropout, path):
    assert packed_attention.varlen_available()  # torch 2.13 has it
    assert attention_path(device, dtype, head_dim, dropout) == path


def test_without_torchs_varlen_api_the_loop_runs_everywhere(monkeypatch):
    monkeypatch.setattr(packed_attention, "varlen_attn", None)
    assert attention_path("cuda", torch.bfloat16, 64) == "loop"

    def older_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        raise AssertionError("never called: this signature has no window_size or enable_gqa")

    monkeypatch.setattr(packed_attention, "varlen_attn", older_varlen_attn)
    assert attention_path("cuda", torch.bfloat16, 64) == "loop"


def reference_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                          enable_gqa=False):
    """What `torch.nn.attention.varlen.varlen_attn` computes (its docstring), with sdpa per sequence on the CPU:
    `[T, H, D]` tokens of the sequences `cu_seq_q`; causal when `window_size` is (-1, 0)."""
    assert torch.equal(cu_seq_q, cu_seq_k) and window_size == (-1, 0)
    assert enable_gqa == (query.shape[1] != key.shape[1])
    starts = cu_seq_q.tolist()
    assert max_q == max_k == max(e - s for s, e in itertools.pairwise(starts))
    out = []
    for s, e in itertools.pairwise(starts):
        q, k, v = (x[s:e].transpose(0, 1)[None] for x in (query, key, value))
        out.append(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                    enable_gqa=enable_gqa)[0].transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("kv_heads", [4, 2])  # 2: grouped-query attention
@pytest.mark.parametrize("rows", [1, 2])
def test_the_varlen_layout_computes_what_the_loop_computes(monkeypatch, kv_heads, rows):
    monkeypatch.setattr(packed_attention, "varlen_attn", reference_varlen_attn)
    g = torch.Generator().manual_seed(0)
    n, d = 11, 8
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]])[:rows]
    q = torch.randn(rows, 4, n, d, generator=g, requires_grad=True)
    k, v = (torch.randn(rows, kv_heads, n, d, generator=g, requires_grad=True) for _ in range(2))
    pack = Pack.of(positions)
    module = torch.nn.Module()
    module.num_key_value_groups = 4 // kv_heads  # what transformers' sdpa repeats the key/value heads by
    loop = looped_packed(module, q, k, v, pack, scaling=0.3)
    varlen = varlen_packed(q, k, v, pack, scale=0.3)
    assert varlen.shape == loop.shape == (rows, n, 4, d)
    torch.testing.assert_close(varlen, loop, rtol=1e-5, atol=1e-6)
    grad = torch.randn(loop.shape, generator=g)
    loop_grads = torch.autograd.grad(loop, (q, k, v), grad)
    for a, b in zip(torch.autograd.grad(varlen, (q, k, v), grad), loop_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_packed_attention_hands_a_varlen_call_the_pack_and_the_scale(monkeypatch):
    """The model-facing function routes by `attention_path` (forced to varlen here) and passes transformers'
    `scaling`; a row of positions shared by many rows of queries stays on the loop."""
    calls = []

    def recording_varlen_attn(*args, **kwargs):
        calls.append(kwargs["scale"])
        return reference_varlen_attn(*args, **kwargs)

    monkeypatch.setattr(packed_attention, "varlen_attn", recording_varlen_attn)
    monkeypatch.setattr(packed_attention, "attention_path", lambda *args: "varlen")
    module = torch.nn.Module()
    q = k = v = torch.randn(1, 2, 7, 8)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    out, _ = packed_attention.packed_attention(module, q, k, v, None, position_ids=positions, scaling=0.5)
    assert calls == [0.5]
    expected = looped_packed(module, q, k, v, Pack.of(positions), scaling=0.5)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    packed_attention.packed_attention(module, q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1),
                                      v.expand(2, -1, -1, -1), None, position_ids=positions, scaling=0.5)
    assert calls == [0.5]  # one row of positions for two rows of queries: the loop
