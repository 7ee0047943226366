"""The tiny model loads through transformers' ordinary paths, its tokenizer is sound, and builds are reproducible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distrl.workers.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_model_loads_and_gives_vocab_sized_logits(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert isinstance(model, LlamaForCausalLM)
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (512, 128, 2, 4)
    assert cfg.tie_word_embeddings is False and cfg.max_position_embeddings == 512
    assert model.dtype == torch.float32
    assert len(tokenizer) == cfg.vocab_size
    ids = tokenizer(["Continue counting: 1 2 3"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()


def test_tokenizer_special_tokens_and_round_trip(tokenizer):
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|bos|>", "<|eos|>", "<|pad|>")
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    text = "Continue counting: 17 18 19\nWhat comes next? 20 — héllo ✓"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and tokenizer.bos_token_id not in ids[1:]  # BOS prepended once
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text


def test_tokenizer_is_trained_on_the_toy_task(tokenizer):
    # 27 characters; merged tokens like "Continue", " counting", " 17" keep it to a handful.
    ids = tokenizer("Continue counting: 17 18 19", add_special_tokens=False)["input_ids"]
    assert len(ids) <= 8


def test_chat_template_renders(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count: 1 2"}]
    with_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert with_prompt == ("<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nCount: 1 2<|eos|>\n<|assistant|>\n")
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == with_prompt.removesuffix("<|assistant|>\n")
    ids = tokenizer(with_prompt, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[:2]) == ["<|bos|>", "<|system|>"]  # role markers are single tokens


def test_chat_template_rejects_unknown_roles(tokenizer):
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="unknown chat role: narrator"):
        tokenizer.apply_chat_template([{"role": "narrator", "content": "x"}], tokenize=False)


def test_same_seed_gives_identical_files(tmp_path, tiny_model_dir):
    again = make_tiny_model(tmp_path / "again")
    names = sorted(p.name for p in tiny_model_dir.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert names == sorted(p.name for p in again.iterdir())
    for name in names:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_model_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()


def test_custom_size_and_corpus(tmp_path):
    out = make_tiny_model(tmp_path / "m", vocab_size=300, hidden_size=64, num_layers=1, num_heads=2,
                          corpus=["aaa bbb ccc"] * 10)
    from transformers import AutoConfig, AutoTokenizer

    cfg, tok = AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 1, 2)
    assert cfg.vocab_size == len(tok) <= 300  # a small corpus yields fewer merges; the model matches the tokenizer
    assert tok.decode(tok("aaa bbb")["input_ids"], skip_special_tokens=True) == "aaa bbb"


def test_vocabulary_leaves_the_toy_reward_room_to_grow(tokenizer):
    # The toy reward is the digit share of a response: if most tokens were numbers, a random model would start
    # near the reward's ceiling and the quickstart could not show learning.
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    share = sum(any(c in "0123456789" for c in t) for t in tokens) / len(tokens)
    assert 0.1 < share < 0.4


def test_qwen2_has_the_features_of_the_models_users_train(tmp_path, tiny_model_dir):
    """Qwen2.5's: the LM head tied to the input embeddings, biases on q/k/v only, 2 query heads per key/value head."""
    from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

    out = make_tiny_model(tmp_path / "qwen2", arch="qwen2")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert isinstance(model, Qwen2ForCausalLM)
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.tie_word_embeddings) == (4, 2, True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    attention = model.model.layers[0].self_attn
    assert [p.bias is not None for p in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj)] \
        == [True, True, True, False]
    assert attention.k_proj.weight.shape == (2 * 32, 128)  # 2 key/value heads of 128 / 4 = 32
    # The tokenizer is the Llama's: only the weights differ.
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    with pytest.raises(ValueError, match="num_heads must be even, got 3"):
        make_tiny_model(tmp_path / "odd", arch="qwen2", num_heads=3)
    with pytest.raises(ValueError, match="tiny model architecture 'gpt2': expected one of llama, qwen2"):
        make_tiny_model(tmp_path / "other", arch="gpt2")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_the_mixtures_of_experts_route_each_token_to_2_of_8_experts(arch, request, tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    out = request.getfixturevalue(f"tiny_{arch}_dir")
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == arch and model.config.num_experts_per_tok == 2
    experts = model.model.layers[1].mlp.experts
    assert experts.gate_up_proj.shape == (8, 2 * 64, 128) and experts.down_proj.shape == (8, 128, 64)
    routed = model(input_ids=torch.tensor([[5, 17, 33, 8]]), output_router_logits=True).router_logits
    assert [tuple(r.shape) for r in routed] == [(4, 8), (4, 8)]  # every layer sparse
    assert (out / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    again = make_tiny_model(tmp_path / arch, arch=arch)
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_tiny_model_being_built_is_not_read_before_it_is_complete(tmp_path, monkeypatch):
    """Actors that start at once all ask for the model: one builds it and the others wait for it, even when they
    look while its config.json exists but is still being written (seen as an empty config.json in a 2 x 2 run)."""
    import threading
    import time

    from distrl.config import ModelConfig
    from distrl.workers import tiny_model
    from distrl.workers.model_files import resolve_model_path

    writing = threading.Event()

    def slow_build(path):
        (Path(path)).mkdir(parents=True, exist_ok=True)
        (Path(path) / "config.json").write_text("")
        writing.set()
        time.sleep(0.5)
        (Path(path) / "config.json").write_text("{}")

    monkeypatch.setattr(tiny_model, "make_tiny_model", slow_build)
    cfg = ModelConfig(path=str(tmp_path / "model"), create_tiny_if_missing=True)
    builder = threading.Thread(target=resolve_model_path, args=(cfg,))
    builder.start()
    assert writing.wait(10)
    resolve_model_path(cfg)
    assert (tmp_path / "model" / "config.json").read_text() == "{}"
    builder.join()


def test_vocabularies_below_the_byte_alphabet_take_the_corpus_characters(tmp_path):
    """Bytes and special tokens make 262 tokens: a smaller vocabulary is built from the corpus's own characters, and
    one that cannot hold them is refused rather than silently exceeded."""
    from transformers import AutoConfig, AutoTokenizer

    out = make_tiny_model(tmp_path / "m", vocab_size=16, hidden_size=16, num_layers=1, num_heads=2,
                          corpus=["0123456789"])
    cfg, tok = AutoConfig.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert cfg.vocab_size == len(tok) == 16
    assert tok.decode(tok("2026")["input_ids"], skip_special_tokens=True) == "2026"
    with pytest.raises(ValueError, match=r"make 17 tokens, more than vocab_size = 16: pass a corpus of fewer"):
        make_tiny_model(tmp_path / "n", vocab_size=16, hidden_size=16, num_layers=1, num_heads=2,
                        corpus=["0123456789a"])
