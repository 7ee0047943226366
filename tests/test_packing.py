"""The packed forward pass (`distrl.workers.model.response_logprobs`) equals the padded one to float32 tolerance,
in log-probs, entropies and gradients, for the tiny Llama and a tiny Qwen2 (tied embeddings, QKV bias, grouped-query
attention); scoring by a token budget gives the rows back in order."""

import pytest
import torch

from distrl.types import Sequences
from distrl.workers.model import padded_response_logprobs, response_logprobs, score_in_micro_batches


def tiny_qwen2():
    """A random Qwen2: tied embeddings, biases on q/k/v (drawn, not left at zero), 4 query heads over 2 KV heads."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         max_position_embeddings=512, dtype="float32")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.config._attn_implementation == "sdpa"
    return model


def tiny_llama(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.config._attn_implementation == "sdpa"
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
                     policy_version=torch.zeros(b, dtype=torch.long))


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
        response_logprobs(model, Sequences(seqs.input_ids, attention, seqs.response_mask, seqs.rollout_logprobs,
                                           seqs.policy_version), 1.0)


@pytest.mark.parametrize("max_tokens", [None, 1, 16, 40])
def test_scoring_by_a_token_budget_keeps_row_order(model, max_tokens):
    seqs = ragged(*BATCH)
    with torch.no_grad():
        whole = padded_response_logprobs(model, seqs, 1.0)[0] * seqs.response_mask
    scored = score_in_micro_batches(model, seqs, 1.0, micro_batch_size=2, max_tokens=max_tokens, min_count=3)
    assert torch.allclose(scored, whole, atol=2e-5, rtol=0)


def test_the_pack_is_as_wide_as_the_longest_sequence():
    from distrl.workers.model import _packed_layout

    # Real lengths 14 5 19 5 7 (prompt + response of BATCH); width 19. First-fit decreasing into rows of 19:
    # 19 (r2) -> row 0; 14 (r0) -> row 1; 7 (r4) -> row 2; 5 (r1) -> row 1 (19); 5 (r3) -> row 2 (12).
    seqs = ragged(*BATCH)
    ids, positions, predicts, response = _packed_layout(seqs)
    assert ids.shape == positions.shape == (3, 19)
    assert positions[1].tolist() == [*range(14), *range(5)]
    assert positions[2].tolist() == [*range(5), *range(7), *[0] * 7]  # filler: position 0, each its own sequence
    real = seqs.attention_mask.bool()
    assert ids[1, :14].tolist() == seqs.input_ids[0][real[0]].tolist()
    # Batch row 0 starts pack row 1 (flat index 19); its 5 prompt tokens sit at 19..23, and the last of them
    # predicts its first response token: the first of the K positions is 19 + 5 - 1 = 23.
    assert predicts.shape == (int(response.sum()),)
    assert predicts[0].item() == 19 + 5 - 1
