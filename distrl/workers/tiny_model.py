"""Build distrl's tiny random test models: a byte-level BPE tokenizer trained on the spot and a random Llama, a
random Qwen2 with the features of the Qwen2.5 models users train (tied embeddings, QKV bias, grouped-query attention),
or a random mixture of experts: a Qwen3-MoE (as Qwen3-30B-A3B: 8 experts, top-2 of them, QK norms, every layer
sparse) or a Mixtral.

No hub is reachable where the tests and the quickstart run, so the model is made locally, in the standard HF
layout (`config.json`, `model.safetensors`, `tokenizer.json`, chat template) that transformers and vLLM both load
through their ordinary code paths. Everything is seeded (BPE training breaks ties deterministically), so every
node that builds it gets byte-identical files.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from distrl.tasks.toy import toy_corpus

if TYPE_CHECKING:
    from transformers import PreTrainedModel

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
CONTEXT_LENGTH = 512
"""Positions the tiny model takes (its max_position_embeddings)."""
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
SPECIAL_TOKENS = (BOS, EOS, PAD, *ROLE_TOKENS)
BYTES = 256
"""Size of the byte-level alphabet: with it, every text is encodable."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "<|system|>\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ '\n\n' }}{% endif %}"
    "# Tools\n\nYou may call functions. Their signatures are within <tools></tools>:\n<tools>"
    "{% for tool in tools %}{{ '\n' }}{{ tool | tojson }}{% endfor %}{{ '\n' }}</tools>\n\n"
    "For each call, write a JSON object with the function's name and arguments within <tool_call></tool_call>:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>{{ eos_token }}\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown chat role: ' ~ message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'tool' %}"
    "<|user|>\n<tool_response>\n{{ message['content'] }}\n</tool_response>{{ eos_token }}\n"
    "{% elif not (tools and loop.first and message['role'] == 'system') %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% for call in message.get('tool_calls') or [] %}"
    "{% if message['content'] or not loop.first %}{{ '\n' }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "{{ eos_token }}\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
"""`<|bos|><|user|>\\nHi<|eos|>\\n<|assistant|>\\n`: the assistant's turn ends with EOS, where sampling stops. With
`tools`, a system turn lists their schemas and the Hermes call format (as Qwen2.5's template does, so vLLM's
`hermes` parser reads the calls); an assistant's `tool_calls` are written in that format, and a `tool` message is a
user turn wrapped in `<tool_response>`. Without tools, the rendering is what it always was."""

GENERIC_TEXT = (
    "The quick brown fox jumps over the lazy dog.",
    "ABCDEFGHIJKLMNOPQRSTUVWXYZ abcdefghijklmnopqrstuvwxyz 0123456789",
    "Question: what is 12 + 30? Answer: 42. The answer is #### 42 or \\boxed{42}.",
    "Please answer the question, then give the final answer on its own line.",
    "Count the numbers one by one and write each of them down.",
    "The next number in the sequence is one more than the last.",
    "Read the question carefully and answer with a number.",
    "She counted the apples on the table and wrote the total.",
    "There are seven days in a week and twelve months in a year.",
    "We start at zero, then one, two, three, four, five, six, seven, eight, nine, ten.",
    "If the list is increasing, continue it with the following value.",
    "What comes after this? Think, then reply.",
)
"""General text, so that words, punctuation and answer formats get tokens too."""


def default_corpus() -> list[str]:
    """The toy task's text plus general text.

    The general text is repeated so that words earn about as many BPE merges as numbers: with a vocabulary
    made mostly of number tokens, a random model would already answer almost only digits, and the toy task's
    reward would start near its ceiling instead of showing it being learned (it starts near 0.3).
    """
    return [*toy_corpus(n=500), *GENERIC_TEXT * 5]


def train_tokenizer(corpus: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` of at most `vocab_size` tokens that prepends BOS when asked to add
    special tokens.

    Its alphabet is every byte when `vocab_size` has room for them and the special tokens (262); below that, only the
    characters of `corpus` (then other characters are not encodable: BPE without an unknown token drops them), and
    `vocab_size` must still hold those and the special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    every_byte = len(SPECIAL_TOKENS) + BYTES <= vocab_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if every_byte else [],
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    if tok.get_vocab_size() > vocab_size:  # the trainer never drops a character of the alphabet to fit
        raise ValueError(f"tiny model tokenizer: the corpus's characters and the {len(SPECIAL_TOKENS)} special "
                         f"tokens make {tok.get_vocab_size()} tokens, more than vocab_size = {vocab_size}: pass a "
                         f"corpus of fewer distinct characters")
    # The ByteLevel post-processor would not prepend BOS; Llama-style tokenizers do, so prompts carry it.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return tok


ARCHITECTURES = ("llama", "qwen2", "qwen3_moe", "mixtral")
EXPERTS, EXPERTS_PER_TOKEN = 8, 2
"""The tiny mixtures of experts: each token routed to 2 of 8 experts per layer."""


def make_tiny_model(out_dir: str | Path, *, arch: str = "llama", vocab_size: int = 512, hidden_size: int = 128,
                    num_layers: int = 2, num_heads: int = 4, seed: int = 0, corpus: list[str] | None = None) -> Path:
    """Write a random causal LM of architecture `arch` and its tokenizer to `out_dir`; returns the directory.

    `llama`: `LlamaForCausalLM`, untied embeddings, full multi-head attention, no biases. `qwen2`:
    `Qwen2ForCausalLM` as in Qwen2.5: the LM head tied to the input embeddings, biases on the q/k/v projections,
    and grouped-query attention with `num_heads // 2` key/value heads. `qwen3_moe` (`Qwen3MoeForCausalLM`) and
    `mixtral` (`MixtralForCausalLM`): every layer's MLP a mixture of `EXPERTS` experts of intermediate size
    `hidden_size // 2`, each token routed to `EXPERTS_PER_TOKEN` of them, grouped-query attention as `qwen2`'s,
    untied embeddings; Qwen3-MoE with its q/k norms and its routing weights not renormalised over the top k
    (`norm_topk_prob=False`, its default), Mixtral's renormalised.

    The tokenizer is trained on `corpus` (default: `default_corpus()`) and has at most `vocab_size` tokens (fewer
    when the corpus runs out of merges; below 262, see `train_tokenizer`); the model's vocabulary is exactly the
    tokenizer's. Same arguments, same bytes.
    """
    import torch
    from transformers import PreTrainedTokenizerFast

    if arch not in ARCHITECTURES:
        raise ValueError(f"tiny model architecture {arch!r}: expected one of {', '.join(ARCHITECTURES)}")
    if arch != "llama" and (num_heads < 2 or num_heads % 2):
        raise ValueError(f"a tiny {arch} shares each key/value head between 2 query heads: num_heads must be even, "
                         f"got {num_heads}")
    out = Path(out_dir)
    raw = train_tokenizer(list(corpus) if corpus is not None else default_corpus(), vocab_size)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        chat_template=CHAT_TEMPLATE, model_max_length=CONTEXT_LENGTH, clean_up_tokenization_spaces=False,
    )
    common = dict(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=4 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, max_position_embeddings=CONTEXT_LENGTH,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = _random_model(arch, common, num_heads)
    model.eval()
    torch.random.set_rng_state(generator_state)  # leave the caller's random stream as it was
    with _no_progress_bar():  # a bar for the one shard of a model made in a second: noise on a run's console
        model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


@contextmanager
def _no_progress_bar() -> Iterator[None]:
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _random_model(arch: str, common: dict[str, Any], num_heads: int) -> PreTrainedModel:
    """A random `arch` model of the `common` sizes (see `make_tiny_model`), drawn from torch's global generator."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**common, num_key_value_heads=num_heads, tie_word_embeddings=False))
    if arch == "qwen2":  # Qwen2's q/k/v projections always carry biases
        return Qwen2ForCausalLM(Qwen2Config(**common, num_key_value_heads=num_heads // 2, tie_word_embeddings=True))
    expert_size = common["hidden_size"] // 2
    moe: dict[str, Any] = dict(num_experts_per_tok=EXPERTS_PER_TOKEN, num_key_value_heads=num_heads // 2,
                               tie_word_embeddings=False)
    if arch == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **moe, num_experts=EXPERTS,
                                                  moe_intermediate_size=expert_size, mlp_only_layers=[]))
    # Mixtral's intermediate_size is each expert's
    return MixtralForCausalLM(MixtralConfig(**{**common, "intermediate_size": expert_size}, **moe,
                                            num_local_experts=EXPERTS))
