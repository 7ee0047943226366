"""Warm start: a tiny random Llama, then a short supervised training on the calculator's call format.

The tokenizer is distrl's tiny BPE tokenizer trained on the chat template's text (the conversations with their
digits taken out, so every number stays one token per digit and the digits of a call's expression are the very
tokens of the prompt's: copying, not arithmetic), plus one added token for the tools' system text, which is the same
in every prompt (the calculator's schema and the call instructions, about 200 tokens otherwise): a tiny model
learns from the problem's few dozen tokens several times faster without them.

Each example is tokenized as distrl's episode runner builds a trajectory (`ChatRenderer`: the prompt, the
model's turn and its end-of-turn token, the template's delta for the tool's answer, the next turn), and only the
model's turns are trained on, so the warm-started model writes exactly what a rollout samples and parses.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path
from typing import Any

import torch

from distrl.agents.chat import ChatRenderer
from distrl.agents.tools.calculator import Calculator
from distrl.workers.tiny_model import BOS, CHAT_TEMPLATE, EOS, default_corpus, make_tiny_model, train_tokenizer
from examples.calculator.problems import conversation

TOOLS = [Calculator().schema()]


def render(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    return tokenizer.apply_chat_template(messages, tools=TOOLS, tokenize=False)


def tools_block(tokenizer: Any) -> str:
    """The text the chat template writes for the offered tools, between the system header and its end of turn."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=TOOLS, tokenize=False)
    start = text.index("<|system|>\n") + len("<|system|>\n")
    return text[start:text.index(tokenizer.eos_token, start)]


def template_corpus(rows: list[dict[str, str]]) -> list[str]:
    """Warm-start conversations of `rows` rendered by the chat template, with their digits taken out, as the
    tokenizer's training text."""
    from transformers import PreTrainedTokenizerFast

    renderer = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(default_corpus(), 512),
                                       chat_template=CHAT_TEMPLATE, bos_token=BOS, eos_token=EOS)
    rng = random.Random(0)
    texts = [render(renderer, conversation(row, use_tool=i % 2 == 0, rng=rng)) for i, row in enumerate(rows)]
    return [re.sub(r"\d", "", text) for text in texts]


def build_model(out_dir: str | Path, rows: list[dict[str, str]], seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden 128) with distrl's tiny tokenizer trained on `rows`' conversations
    (`template_corpus`), in which the tools' system text (`tools_block`) is one token."""
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_tiny_model(out_dir, vocab_size=512, hidden_size=128, num_layers=2, num_heads=4, seed=seed,
                          corpus=template_corpus(rows))
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_tokens([AddedToken(tools_block(tokenizer), normalized=False, special=False)])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def example_ids(tokenizer: Any, row: dict[str, str], use_tool: bool,
                rng: random.Random) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one warm-start example, token for token what an episode's trajectory holds."""
    chat, eos = ChatRenderer(tokenizer), tokenizer.eos_token_id
    messages = conversation(row, use_tool, rng)
    ids = chat.prompt_ids(messages[:1], TOOLS)
    mask = [0] * len(ids)
    for k, message in enumerate(messages[1:], start=1):
        if message["role"] == "assistant":
            text = message["content"]
            for call in message.get("tool_calls", []):  # the markup the template (and the hermes parser) uses
                f = call["function"]
                text += f"<tool_call>\n{json.dumps({'name': f['name'], 'arguments': f['arguments']})}\n</tool_call>"
            turn = [*tokenizer.encode(text, add_special_tokens=False), eos]
            ids, mask = ids + turn, mask + [1] * len(turn)
        else:
            observation = chat.observation_ids(messages[k:k + 1], TOOLS, eos)
            ids, mask = ids + observation, mask + [0] * len(observation)
    return ids, mask


def batches(tokenizer: Any, rows: list[dict[str, str]], tool_frac: float, batch_size: int, seed: int):
    """Endless padded batches (input ids [B, T], labels [B, T] with -100 off the model's turns) of examples drawn
    from `rows`, a `tool_frac` share of them with a calculator call."""
    rng = random.Random(seed)
    while True:
        examples = [example_ids(tokenizer, rng.choice(rows), rng.random() < tool_frac, rng) for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in examples)
        input_ids = torch.full((batch_size, width), tokenizer.pad_token_id)
        labels = torch.full((batch_size, width), -100)
        for i, (ids, mask) in enumerate(examples):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            labels[i, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask, strict=True)])
        yield input_ids, labels


def warm_start(model_dir: str | Path, out_dir: str | Path, rows: list[dict[str, str]], *, steps: int = 800,
               tool_frac: float = 0.5, batch_size: int = 32, lr: float = 3e-3, seed: int = 0,
               log_every: int = 50) -> list[float]:
    """Train the model at `model_dir` on warm-start examples of `rows` for `steps` steps and save it, with its
    tokenizer, to `out_dir`; returns the loss of every step."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 20))
    losses, began = [], time.perf_counter()
    examples = batches(tokenizer, rows, tool_frac, batch_size, seed)
    for step in range(steps):
        input_ids, labels = next(examples)
        loss = model(input_ids=input_ids, attention_mask=input_ids != tokenizer.pad_token_id,
                     labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
        if log_every and (step + 1) % log_every == 0:
            print(f"warm start step {step + 1}/{steps}: loss {loss:.3f} ({time.perf_counter() - began:.0f} s)")
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return losses
