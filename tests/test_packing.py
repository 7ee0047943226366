"""The packed forward pass (`distrl.workers.training.model.response_logprobs`, one row of real tokens, attention kept
within each sequence by `PACKED_ATTENTION`) equals the padded one to float32 tolerance, in log-probs, entropies and
gradients, for the tiny Llama and a tiny Qwen2 (tied embeddings, QKV bias, grouped-query attention); scoring by a
token budget gives the rows back in order."""

import dataclasses

import pytest
import torch

from distrl.micro_batches import micro_batches
from distrl.types.batches import Sequences
from distrl.workers.training.model import (
    padded_response_logprobs,
    response_logprobs,
    score_in_micro_batches,
    score_rows,
)
from distrl.workers.training.packed_attention import PACKED_ATTENTION, sequence_bounds


def tiny_qwen2():
    """A random Qwen2: tied embeddings, biases on q/k/v (drawn, not left at zero), 4 query heads over 2 KV heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=512, dtype="float32", attn_implementation=PACKED_ATTENTION)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == PACKED_ATTENTION
    return model


def tiny_llama(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=PACKED_ATTENTION)
    assert model.config._attn_implementation == PACKED_ATTENTION
    return model


@pytest.fixture(params=["llama", "qwen2"])
def model(request, tiny_model_dir):
    return tiny_llama(tiny_model_dir) if request.param == "llama" else tiny_qwen2()


def ragged(prompt_lens: list[int], response_lens: list[int], seed: int = 0) -> Sequences:
    """Left-padded prompts and right-padded responses of the given lengths (real tokens only where they say)."""
    g = torch.Generator().manual_seed(seed)
    b, p, t = len(prompt_lens), max(prompt_lens), max(response_lens)
    ids = torch.randint(3, 500, (b, p + t), generator=g)
    attention = torch.zeros(b, p + t, dtype=torch.long)
    for i, (pl, rl) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        attention[i, p - pl : p + rl] = 1
    mask = attention[:, p:].float()
    mask[0, 0] = 0.0  # a real token outside the loss must still be scored like the padded pass scores it
    return Sequences(input_ids=ids, attention_mask=attention, response_mask=mask, rollout_logprobs=torch.zeros(b, t),
                     policy_version=torch.zeros(b, dtype=torch.long),
                     response_versions=torch.zeros(b, t, dtype=torch.long))


BATCH = ([5, 2, 7, 4, 1], [9, 3, 12, 1, 6])
"""Prompts of 1-7 and responses of 1-12 tokens: every row is padded on one side or both."""


def test_packed_logprobs_and_entropies_equal_padded(model):
    seqs = ragged(*BATCH)
    real = seqs.attention_mask[:, seqs.prompt_len :].bool()
    with torch.no_grad():
        padded, padded_entropy = padded_response_logprobs(model, seqs, temperature=0.7, with_entropy=True)
        packed, packed_entropy = response_logprobs(model, seqs, temperature=0.7, with_entropy=True)
    assert packed.shape == packed_entropy.shape == (5, 12) and packed.dtype == torch.float32
    assert torch.allclose(packed[real], padded[real], atol=2e-5, rtol=0)
    assert torch.allclose(packed_entropy[real], padded_entropy[real], atol=2e-5, rtol=0)
    assert not packed[~real].any() and not packed_entropy[~real].any()  # padding is 0, not a stray value
    assert padded[real].std() > 0.1  # the model's log-probs vary by token, so the comparison can fail


def test_packed_gradients_equal_padded(model):
    seqs = ragged(*BATCH, seed=1)
    weights = torch.randn(seqs.response_mask.shape, generator=torch.Generator().manual_seed(2)) * seqs.response_mask
    grads = []
    for forward in (padded_response_logprobs, response_logprobs):
        model.zero_grad()
        logprobs, entropy = forward(model, seqs, temperature=1.3, with_entropy=True)
        ((logprobs + 0.1 * entropy) * weights).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    padded, packed = grads
    assert padded.keys() == packed.keys() and len(packed) == len(list(model.parameters()))
    for name, g in padded.items():
        scale = g.abs().max().clamp(min=1e-6)
        assert ((packed[name] - g).abs().max() / scale) < 1e-4, name


def test_one_row_and_zero_rows(model):
    seqs = ragged(*BATCH)
    with torch.no_grad():
        alone = response_logprobs(model, seqs.select(slice(2, 3)), 1.0)[0]
        together = response_logprobs(model, seqs, 1.0)[0]
    assert torch.allclose(alone[0], together[2], atol=2e-5)
    # Zero rows (an empty micro-batch of a sharded learner): `[0, T]`, and a backward that runs through the model.
    empty, entropy = response_logprobs(model, seqs.select(torch.tensor([], dtype=torch.long)), 1.0, True)
    assert empty.shape == entropy.shape == (0, 12)
    model.zero_grad()
    empty.sum().backward()
    assert model.lm_head.weight.grad is not None and not model.lm_head.weight.grad.any()


def test_a_response_after_padding_is_rejected(model):
    seqs = ragged([2, 2], [3, 3])
    attention = seqs.attention_mask.clone()
    attention[1, :2] = 0  # row 1 has no prompt token left to predict its first response token from
    with pytest.raises(ValueError, match="real prompt token"):
        response_logprobs(model, dataclasses.replace(seqs, attention_mask=attention), 1.0)


@pytest.mark.parametrize("max_tokens", [None, 1, 16, 40])
def test_scoring_by_a_token_budget_keeps_row_order(model, max_tokens):
    seqs = ragged(*BATCH)
    with torch.no_grad():
        whole = padded_response_logprobs(model, seqs, 1.0)[0] * seqs.response_mask
    scored = score_in_micro_batches(model, seqs, 1.0, micro_batch_size=2, max_tokens=max_tokens)
    assert torch.allclose(scored, whole, atol=2e-5, rtol=0)
    # At least 6 groups for 5 rows: split until one row each, then an empty group (a lockstep's), still in order.
    groups = micro_batches(seqs.attention_mask.sum(-1).tolist(), 2, max_tokens, min_count=6)
    assert len(groups) == 6 and [] in groups
    rows = score_rows(lambda micro, layout: response_logprobs(model, micro, 1.0, layout=layout)[0], seqs, groups,
                      "cpu")
    assert torch.allclose(rows, whole, atol=2e-5, rtol=0)


def test_the_pack_is_one_row_of_the_real_tokens():
    from distrl.workers.training.packed_attention import Pack
    from distrl.workers.training.packing import host_layout

    # Real lengths 14 5 19 5 7 (prompt + response of BATCH), side by side in batch order: 50 tokens, no filler.
    seqs = ragged(*BATCH)
    layout = host_layout(seqs)
    ids, positions, predicts, response = layout.ids, layout.position_ids, layout.predicts, layout.response
    assert ids.shape == positions.shape == (1, 50)
    assert positions[0].tolist() == [*range(14), *range(5), *range(19), *range(5), *range(7)]
    assert ids[0].tolist() == seqs.input_ids[seqs.attention_mask.bool()].tolist()
    assert sequence_bounds(positions[0]) == [(0, 14), (14, 19), (19, 38), (38, 43), (43, 50)]
    # The host's pack is the one the attention would find in the positions, cu_seqlens and longest included.
    found = Pack.of(positions)
    assert layout.pack.bounds == found.bounds and layout.pack.longest == found.longest == 19
    assert layout.pack.cu_seqlens.tolist() == found.cu_seqlens.tolist() == [0, 14, 19, 38, 43, 50]
    # Row 0's 5 prompt tokens sit at 0..4, and the last of them predicts its first response token: K starts at 4.
    # Row 1 (prompt 2, response 3) starts at 14: its predicting positions are 15, 16, 17.
    assert predicts.shape == layout.targets.shape == (int(response.sum()),)
    assert predicts[:12].tolist() == [*range(4, 13), 15, 16, 17]
    assert layout.targets.tolist() == ids[0, predicts + 1].tolist()
    assert layout.response_index.tolist() == response.view(-1).nonzero().view(-1).tolist()


def test_sequence_bounds_follow_the_restarts_of_the_positions():
    assert sequence_bounds(torch.tensor([0, 1, 2, 0, 1, 0, 0, 1])) == [(0, 3), (3, 5), (5, 6), (6, 8)]
    assert sequence_bounds(torch.tensor([3, 4, 5])) == [(0, 3)]  # one sequence that starts late
    assert sequence_bounds(torch.tensor([0])) == [(0, 1)]


def test_packing_refuses_a_model_whose_attention_would_mix_the_sequences(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)  # sdpa
    with pytest.raises(ValueError, match="does not keep apart: load it with attn_implementation='distrl_packed'"):
        response_logprobs(model, ragged(*BATCH), 1.0)


def test_a_packed_model_runs_padded_batches_and_plain_rows_as_sdpa(tiny_model_dir):
    """The packed implementation is sdpa wherever a mask is given or each row is one sequence."""
    from transformers import AutoModelForCausalLM

    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    seqs = ragged(*BATCH)
    with torch.no_grad():
        packed_model = tiny_llama(tiny_model_dir)
        assert torch.equal(padded_response_logprobs(packed_model, seqs, 1.0)[0],
                           padded_response_logprobs(sdpa, seqs, 1.0)[0])
        ids = seqs.input_ids[:, :6]
        assert torch.equal(packed_model(input_ids=ids).logits, sdpa(input_ids=ids).logits)


def test_packed_values_equal_padded(tiny_model_dir):
    """The critic's packed values equal a padded forward pass of the same value model, read at position P - 1 + t
    of each row (positions counted from its first real token), on every real response token; 0 on padding."""
    from transformers import AutoModelForTokenClassification

    from distrl.workers.training.critic import response_values

    torch.manual_seed(0)
    model = AutoModelForTokenClassification.from_pretrained(tiny_model_dir, num_labels=1, dtype=torch.float32,
                                                            attn_implementation=PACKED_ATTENTION)
    seqs = ragged(*BATCH)
    p, t = seqs.prompt_len, seqs.response_len
    with torch.no_grad():
        positions = (seqs.attention_mask.cumsum(-1) - 1).clamp(min=0)
        padded = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask,
                       position_ids=positions).logits[:, p - 1 : p - 1 + t, 0]
        packed = response_values(model, seqs)
        empty = response_values(model, seqs.select(torch.tensor([], dtype=torch.long)))
    real = seqs.attention_mask[:, p:].bool()
    assert torch.allclose(packed[real], padded[real], atol=2e-5, rtol=0) and padded[real].std() > 0.01
    assert not packed[~real].any() and empty.shape == (0, t)


def test_a_sequence_longer_than_a_sliding_window_is_refused():
    """Sliding-window layers see the same as causal ones within the window; beyond it the pack would be wrong."""
    from distrl.workers.training.packed_attention import packed_attention

    module = torch.nn.Module()
    q = k = v = torch.randn(1, 2, 7, 4)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    within = packed_attention(module, q, k, v, None, position_ids=positions, sliding_window=4)[0]
    assert torch.equal(within, packed_attention(module, q, k, v, None, position_ids=positions)[0])
    with pytest.raises(ValueError, match="sequence of 4 tokens is longer than the model's sliding_window"):
        packed_attention(module, q, k, v, None, position_ids=positions, sliding_window=3)


def test_the_sequences_of_a_pack_come_from_the_host(tiny_model_dir, monkeypatch):
    """The layout made on the host tells the attention where the sequences are: they are never searched for in the
    device's positions (which waits for a GPU), in any layer; a caller that gives only positions has them found
    once per forward pass."""
    from distrl.workers.training import packed_attention
    from distrl.workers.training.model import packed_inputs
    from distrl.workers.training.packing import host_layout

    found = []
    real = packed_attention.sequence_bounds
    monkeypatch.setattr(packed_attention, "sequence_bounds", lambda row: found.append(1) or real(row))
    model = tiny_llama(tiny_model_dir)
    assert model.config.num_hidden_layers > 1
    with torch.no_grad():
        response_logprobs(model, ragged(*BATCH), 1.0)
        response_logprobs(model, ragged(*BATCH, seed=3), 1.0)
        assert found == []
        inputs = packed_inputs(model, host_layout(ragged(*BATCH)))
        model(input_ids=inputs["input_ids"], position_ids=inputs["position_ids"].clone())  # positions alone
    assert len(found) == 1  # one search for the one pass, not one per layer
